"""The single-process reference of every parallel correctness test.

:func:`train_reference` trains a model in this process, float32 with one intra-op thread,
on the same batches a parallel run sees, and records what a parallel run is compared with:
each step's loss, every parameter's gradient (by FQN, as the optimizer steps it: averaged
over micro-batches, after clipping when ``max_norm`` is given) and the optimizer state by
FQN after each step. The micro-batch order is explicit: a batch is cut along dim 0 into
``micro_batches`` equal pieces, taken in order 0..m-1, each piece's loss divided by m
before its backward (the mean of the pieces' means: equal to the whole batch's mean loss
when every piece holds as many loss terms). ``micro_batches=1`` steps on the whole batch.

A batch is a dict of keyword arguments (a ``transformers`` model's ``input_ids`` and
``labels``; the default ``loss_fn`` returns ``model(**batch).loss``) or anything
``loss_fn(model, batch)`` takes, such as an ``(inputs, targets)`` tuple.

Example::

    run = train_reference(lambda: build_tiny_hf_model("llama"), batches, lambda m: SGD(m.parameters(), 0.1))
    assert len(run.losses) == len(batches)
    first = run.gradients[0]                      # {fqn: gradient of step 1}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vescale.dtensor.testing.numerics import assert_close_by_fqn, assert_losses_close

__all__ = [
    "ReferenceRun",
    "assert_matches_reference",
    "assert_runs_match_reference",
    "micro_batch",
    "model_loss",
    "optimizer_state_by_fqn",
    "train_reference",
    "train_steps",
]


@dataclass(frozen=True)
class ReferenceRun:
    """What :func:`train_reference` recorded: per step, the loss, the gradients and the optimizer
    state (both ``{fqn: ...}``) and, with clipping, the total gradient norm before clipping; the
    parameters before the first and after the last step."""

    losses: list[float]
    gradients: list[dict[str, torch.Tensor]]
    optimizer_states: list[dict[str, dict[str, torch.Tensor]]]
    grad_norms: list[float]
    initial_parameters: dict[str, torch.Tensor]
    parameters: dict[str, torch.Tensor]
    # Second names of tied parameters (``lm_head.weight`` of a tied GPT-2) -> the recorded FQN.
    tied: dict[str, str] = field(default_factory=dict)

    def first_gradients(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The first step's gradients by FQN, for ``names`` (tied second names included) or all.

        Example::

            expected = reference.first_gradients(["lm_head.weight"])   # wte's, on a tied GPT-2
        """
        gradients = self.gradients[0]
        return {
            name: gradients[self.tied.get(name, name)] for name in (gradients if names is None else names)
        }


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default loss: ``model(**batch).loss`` (a ``transformers`` causal LM with ``labels``)."""
    loss: torch.Tensor = model(**batch).loss
    return loss


def micro_batch(batch: Any, index: int, count: int) -> Any:
    """Piece ``index`` of ``count`` of ``batch`` along dim 0 (dict values or tuple items alike).

    Example::

        first = micro_batch({"input_ids": ids, "labels": ids}, 0, 2)   # rows 0..B/2-1
    """
    if count == 1:
        return batch
    if isinstance(batch, Mapping):
        return {key: value.chunk(count)[index] for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(item.chunk(count)[index] for item in batch)
    return batch.chunk(count)[index]


def optimizer_state_by_fqn(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state keyed by parameter FQN (tensors cloned, scalars as tensors).

    Example::

        state = optimizer_state_by_fqn(model, optimizer)
        state["lm_head.weight"]["exp_avg"]
    """
    names = {id(parameter): fqn for fqn, parameter in model.named_parameters()}
    states = {}
    for parameter, state in optimizer.state.items():
        if id(parameter) in names:
            states[names[id(parameter)]] = {
                key: (value.detach().clone() if torch.is_tensor(value) else torch.tensor(value))
                for key, value in state.items()
            }
    return states


def _tied_names(model: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    tied = {}
    for fqn, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied[fqn] = first[id(parameter)]
        else:
            first[id(parameter)] = fqn
    return tied


def assert_matches_reference(
    reference: ReferenceRun,
    losses: Sequence[Sequence[float]] = (),
    gradients: Sequence[Mapping[str, torch.Tensor]] = (),
    *,
    loss_rtol: float,
    grad_rtol: float | None = None,
    label: str = "",
) -> tuple[float, float]:
    """Fail unless every run's losses and the first-step gradients match ``reference``; return both worst.

    ``losses`` holds one list per rank (or run); ``gradients`` one ``{fqn: gradient}`` per rank,
    merged: together they must cover every parameter (pipeline ranks hold different stages).
    The messages name the worst step or FQN (:func:`~vescale.dtensor.testing.numerics.assert_close_by_fqn`).

    Example::

        errors = assert_matches_reference(reference, losses, gradients, loss_rtol=1e-4, grad_rtol=1e-5)
    """
    loss_error = max((assert_losses_close(run, reference.losses, loss_rtol) for run in losses), default=0.0)
    if not gradients:
        return loss_error, 0.0
    merged: dict[str, torch.Tensor] = {}
    for rank_gradients in gradients:
        merged.update(rank_gradients)
    missing = sorted(set(reference.gradients[0]) - {reference.tied.get(name, name) for name in merged})
    if missing:
        raise AssertionError(f"{label}: no rank returned the gradient of {missing[:5]} ({len(missing)} FQNs)")
    what = f"{label} first-step gradient".strip()
    grad_error = assert_close_by_fqn(merged, reference.first_gradients(merged), grad_rtol or 0.0, what)
    return loss_error, grad_error


def assert_runs_match_reference(
    reference: ReferenceRun,
    runs: Sequence[Mapping[str, Any]],
    *,
    loss_rtol: float,
    grad_rtol: float | None = None,
    label: str = "",
) -> tuple[float, float]:
    """:func:`assert_matches_reference` on what ``run_on_ranks`` returned: one dict per rank with that
    rank's ``"losses"`` and its ``{fqn: gradient}`` under ``"gradients"`` (other keys are left alone).

    Example::

        runs = run_on_ranks(train_on_rank, 4)   # each rank: {"losses": [...], "gradients": {...}}
        errors = assert_runs_match_reference(reference, runs, loss_rtol=1e-4, grad_rtol=1e-5, label="ep2")
    """
    losses = [run["losses"] for run in runs]
    gradients = [run["gradients"] for run in runs]
    return assert_matches_reference(
        reference, losses, gradients, loss_rtol=loss_rtol, grad_rtol=grad_rtol, label=label
    )


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = model_loss,
) -> list[float]:
    """The plain loop a user writes (zero_grad, loss, backward, step) over ``batches``; each step's loss.

    Example::

        losses = train_steps(parallel_model, optimizer, data_loader)
    """
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_reference(
    build_model: Callable[[], nn.Module],
    batches: Iterable[Any],
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = model_loss,
    micro_batches: int = 1,
    seed: int = 0,
    max_norm: float | None = None,
    scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
    divide_gradients: bool = False,
) -> ReferenceRun:
    """Train ``build_model()`` (built after ``torch.manual_seed(seed)``) on ``batches`` in one process.

    Each step: zero the gradients, run the micro-batches in order (see the module docstring),
    clip to ``max_norm`` when given, record the gradients, step the optimizer (and the
    scheduler from ``scheduler_fn``), record the optimizer state. ``divide_gradients`` runs the
    micro-batches' unscaled losses backward and divides the summed gradients by m once, as
    PyTorch's pipeline schedules do (bitwise comparisons need the same arithmetic).

    Example::

        run = train_reference(build_tiny_mlp, batches, adamw, loss_fn=mse_loss, micro_batches=2)
        run.losses[0], run.gradients[0]["head.weight"], run.optimizer_states[-1]["head.bias"]["exp_avg"]
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = build_model()
        optimizer = optimizer_fn(model)
        scheduler = scheduler_fn(optimizer) if scheduler_fn is not None else None
        initial = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
        losses, gradients, states, norms = [], [], [], []
        for batch in batches:
            optimizer.zero_grad()
            micro_losses = []
            for index in range(micro_batches):
                loss = loss_fn(model, micro_batch(batch, index, micro_batches))
                scaled = loss if divide_gradients or micro_batches == 1 else loss / micro_batches
                scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
                micro_losses.append(loss.detach())
            if divide_gradients and micro_batches > 1:
                for parameter in model.parameters():
                    if parameter.grad is not None:
                        parameter.grad.div_(micro_batches)
            if max_norm is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            gradients.append(
                {fqn: p.grad.detach().clone() for fqn, p in model.named_parameters() if p.grad is not None}
            )
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            losses.append((torch.stack(micro_losses).sum() / micro_batches).item())
            states.append(optimizer_state_by_fqn(model, optimizer))
        parameters = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
        return ReferenceRun(losses, gradients, states, norms, initial, parameters, _tied_names(model))
    finally:
        torch.set_num_threads(threads)
