"""One sweep cell: an architecture under one mode, judged against its single-process reference.

A cell is ``pass`` (every compared number within its bound), ``silent`` (the run finished
without an error but a number is off: the worst outcome), ``error`` (an exception or a hang;
the cell shows the error's first line) or ``not runnable`` (the architecture does not train in
one process at its tiny configuration, so it has no reference).

Example::

    cell = Cell.from_error(ValueError("bad plan"))
    assert cell.status == "error" and cell.text == "ValueError: bad plan"
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ERROR_TEXT_CHARS",
    "FLOOR_FACTOR",
    "GRAD_RTOL",
    "LOSS_OP_EPSILON",
    "LOSS_RTOL",
    "STATUSES",
    "STEP_LOSS_RTOL",
    "Cell",
    "error_line",
    "judge_losses",
    "judge_step",
    "loss_floor",
]

LOSS_RTOL = 1e-5  # one step's loss under TP (issue 18): sharded sums differ by a few ulps
GRAD_RTOL = 1e-4  # every gradient, ‖parallel − reference‖∞ / ‖reference‖∞
STEP_LOSS_RTOL = 1e-4  # the losses of several optimizer steps (AdamW amplifies the ulps)
ERROR_TEXT_CHARS = 120
STATUSES = ("pass", "error", "silent", "not runnable")
# A gradient whose reference is below this fraction of the model's largest gradient is zero in
# exact arithmetic (vescale.dtensor.testing.numerics): measured against the largest one instead.
ZERO_GRADIENT_FRACTION = 1e-6
# With a float64 run of the same step, a number is judged against the exact value, and its bound
# grows by this many times the float32 reference's own error on that number (its noise floor):
# two float32 computations that sum in different orders each land within about the floor of the
# exact value (XLM at TP=4: 2.9e-5 from the exact loss, where one float32 process is 4.9e-5 off).
# A placement bug moves a number by far more than its rounding (DiffLlama's was 1.7 relative).
FLOOR_FACTOR = 4.0
# transformers computes the loss in float32 even from float64 logits (it upcasts to float32 only),
# so the float64 run shares the loss op's own rounding and its error cannot measure it: a
# log-sum-exp led by its largest term rounds on the scale of 1, an absolute error of about one
# float32 epsilon per token, whatever the arithmetic before it. On a near-zero loss that is a
# relative error the measured floor may miss: XLM's loss is 9.5e-4, and on an AVX2 CPU its
# float32 reference lands 2.5e-6 from the float64 one by luck while TP=4, summing in another
# order, lands 3.7e-5 away (within eps32 / 9.5e-4 = 1.3e-4). A loss near log(vocab) is unaffected.
LOSS_OP_EPSILON = 2.0**-23


def error_line(error: BaseException | str, limit: int | None = ERROR_TEXT_CHARS) -> str:
    """``Type: first line of the message``, trimmed to ``limit`` characters (None: whole)."""
    if isinstance(error, BaseException):
        message = (str(error).strip().splitlines() or [""])[0]
        text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    else:
        text = error
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Cell:
    """The outcome of one architecture under one mode."""

    status: str
    text: str
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_error(cls, error: BaseException | str, seconds: float = 0.0, **details: Any) -> Cell:
        return cls("error", error_line(error), seconds, {"error": error_line(error, None), **details})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Cell:
        return cls(**values)


def _relative(parallel, reference, scale: float | None = None) -> float:
    difference = (parallel.double() - reference.double()).abs().max().item()
    denominator = scale if scale is not None else reference.double().abs().max().item()
    if math.isnan(difference):
        return math.inf
    if denominator == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return difference / denominator


def judge_step(
    loss: float,
    gradients: dict[str, Any],
    reference_loss: float,
    reference_gradients: dict[str, Any],
    seconds: float = 0.0,
    exact: tuple[float, dict[str, Any]] | None = None,
) -> Cell:
    """Compare one step's loss (``LOSS_RTOL``) and every gradient (``GRAD_RTOL``) with the reference.

    ``exact`` is the same step in float64: then each number is compared with its exact value and
    its bound is ``RTOL + FLOOR_FACTOR × (float32 reference's own error)``, so that a case whose
    float32 arithmetic is itself that far off (a loss near zero) is judged by what a bug would
    change, not by rounding. The loss's floor is at least its loss op's own rounding
    (:func:`loss_floor`), which the float64 run shares and so cannot measure.
    """
    exact_loss, exact_gradients = exact if exact is not None else (None, None)
    truth_loss = reference_loss if exact_loss is None else exact_loss
    measured_floor = 0.0 if exact_loss is None else _relative_value(reference_loss, exact_loss)
    loss_bound_floor = loss_floor(measured_floor, truth_loss)
    loss_error = _relative_value(loss, truth_loss)
    scale = max(
        (grad.abs().max().item() for grad in reference_gradients.values() if grad is not None), default=0.0
    )
    grad_errors: dict[str, float] = {}
    grad_excess: dict[str, float] = {}
    problems: list[str] = []
    for name, reference_grad in reference_gradients.items():
        grad = gradients.get(name, "missing")
        if isinstance(grad, str) or (grad is None) != (reference_grad is None):
            problems.append(
                f"gradient of {name} is {'missing' if grad is None or grad == 'missing' else 'extra'}"
            )
            continue
        if grad is None:
            continue
        if tuple(grad.shape) != tuple(reference_grad.shape):
            problems.append(
                f"gradient of {name} has shape {tuple(grad.shape)}, reference {tuple(reference_grad.shape)}"
            )
            continue
        own = reference_grad.abs().max().item()
        denominator = scale if own < ZERO_GRADIENT_FRACTION * scale else None
        exact_grad = None if exact_gradients is None else exact_gradients.get(name)
        if exact_grad is None:
            grad_errors[name] = _relative(grad, reference_grad, denominator)
            grad_excess[name] = grad_errors[name] / GRAD_RTOL
        else:
            floor = _relative(reference_grad, exact_grad, denominator)
            grad_errors[name] = _relative(grad, exact_grad, denominator)
            grad_excess[name] = grad_errors[name] / (GRAD_RTOL + FLOOR_FACTOR * floor)
    extra = sorted(set(gradients) - set(reference_gradients))
    if extra:
        problems.append(f"parameters not in the reference: {extra[0]}")
    worst = max(grad_excess.items(), key=lambda item: item[1], default=("", 0.0))
    worst_error = (worst[0], grad_errors.get(worst[0], 0.0))
    details = {
        "loss_error": loss_error,
        "loss_floor": loss_bound_floor,
        "loss_floor_measured": measured_floor,
        "worst_grad": list(worst_error),
        "worst_grad_over_bound": worst[1],
        "loss": loss,
        "reference_loss": reference_loss,
        "exact_reference": exact is not None,
    }
    if problems:
        return Cell("silent", error_line(f"✘ silently wrong: {problems[0]}"), seconds, details)
    loss_bad = loss_error > LOSS_RTOL + FLOOR_FACTOR * loss_bound_floor
    grad_bad = worst[1] > 1.0
    if loss_bad:
        text = f"✘ silently wrong: loss rel {loss_error:.1e}"
        if grad_bad:
            text += f", grad {worst_error[0]} rel {worst_error[1]:.1e}"
        return Cell("silent", error_line(text), seconds, details)
    if grad_bad:
        return Cell(
            "silent",
            error_line(f"✘ silently wrong: grad {worst_error[0]} rel {worst_error[1]:.1e}"),
            seconds,
            details,
        )
    return Cell("pass", "✔", seconds, details)


def loss_floor(measured: float, loss: float) -> float:
    """A loss's relative noise floor: the float32 reference's measured error, or the loss op's own
    rounding (:data:`LOSS_OP_EPSILON` absolute) where that is larger.

    Example::

        loss_floor(2.5e-6, 9.5e-4)   # 1.25e-4: XLM's near-zero loss
        loss_floor(0.0, 4.8)         # 2.5e-8: a loss near log(vocab)
    """
    return max(measured, LOSS_OP_EPSILON / abs(loss)) if loss else measured


def _relative_value(value: float, reference: float) -> float:
    error = abs(value - reference) / abs(reference) if reference else abs(value)
    return math.inf if math.isnan(error) else error


def judge_losses(
    losses: list[float],
    reference: list[float],
    seconds: float = 0.0,
    what: str = "loss",
    exact: list[float] | None = None,
) -> Cell:
    """Compare per-step losses with the reference's (``STEP_LOSS_RTOL`` at every step).

    ``exact`` is the same training in float64: then each loss is compared with the exact one
    and its bound grows by ``FLOOR_FACTOR`` × the float32 reference's own error up to the next step,
    as :func:`judge_step` does (XLM's near-zero losses are 1e-4 off in float32 alone).
    """
    if len(losses) != len(reference):
        return Cell(
            "silent", f"✘ silently wrong: {len(losses)} steps ({what}), reference {len(reference)}", seconds
        )
    truth = reference if exact is None else exact[: len(reference)]
    errors = [_relative_value(value, true) for value, true in zip(losses, truth, strict=True)]
    floors = [0.0 if exact is None else _relative_value(a, b) for a, b in zip(reference, truth, strict=True)]
    # Training amplifies rounding: AdamW turns the float32 noise of near-zero gradient elements into
    # whole learning-rate steps, so on an ill-conditioned tiny model two float32 runs part
    # exponentially (Gemma-4: about x10 a step), and a run that parts one step earlier is ~10x
    # further off at the same step. Step k is judged against the reference's own error up to k+1.
    # The loss op's own rounding (loss_floor) is the step's alone: training does not carry it.
    reached = [loss_floor(max(floors[: step + 2]), truth[step]) for step in range(len(floors))]
    excess = [
        error / (STEP_LOSS_RTOL + FLOOR_FACTOR * floor) for error, floor in zip(errors, reached, strict=True)
    ]
    step = max(range(len(excess)), key=excess.__getitem__, default=0)
    details = {
        "loss_errors": errors,
        "loss_floors": floors,
        "loss_floors_reached": reached,
        "losses": losses,
        "reference": reference,
        "exact_reference": exact is not None,
    }
    if excess and excess[step] > 1.0:
        return Cell(
            "silent", f"✘ silently wrong: {what} of step {step + 1} rel {errors[step]:.1e}", seconds, details
        )
    return Cell("pass", "✔", seconds, details)
