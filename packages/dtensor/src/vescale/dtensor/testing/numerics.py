"""How parallel results are compared with their single-process reference.

GUIDE §4's measure is the relative error ‖parallel − reference‖∞ / ‖reference‖∞. A few
gradients are zero in exact arithmetic (a key-projection bias: softmax ignores a shift
shared by every key), so their reference is rounding noise and a relative error against
it means nothing: a gradient whose reference is below ``ZERO_GRADIENT_FRACTION`` of the
model's largest gradient is measured against that largest gradient instead.

Example::

    errors = gradient_errors(parallel_model, reference_model)   # {fqn: relative error}
    assert max(errors.values()) <= 1e-4
    assert_close_by_fqn(parallel_gradients, reference.gradients[0], 1e-6)  # names the worst FQN
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "ZERO_GRADIENT_FRACTION",
    "assert_close_by_fqn",
    "assert_losses_close",
    "errors_by_fqn",
    "full_gradients",
    "full_parameters",
    "full_value",
    "gradient_errors",
    "innermost_module",
    "max_relative_error",
    "relative_error",
    "sgd_step_gradients",
]

ZERO_GRADIENT_FRACTION = 1e-6


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The single-device value of a tensor or DTensor, detached."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def relative_error(parallel: torch.Tensor, reference: torch.Tensor, scale: float | None = None) -> float:
    """‖parallel − reference‖∞ / ‖reference‖∞ (or / ``scale`` when given).

    Example::

        assert relative_error(loss, reference_loss) <= 1e-5
    """
    difference = (full_value(parallel).double() - reference.detach().double()).abs().max().item()
    denominator = scale if scale is not None else reference.detach().double().abs().max().item()
    if denominator == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / denominator


def errors_by_fqn(
    parallel: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    names: Iterable[str] | None = None,
) -> dict[str, float]:
    """Per FQN of ``reference`` (or of ``names``), the relative error of ``parallel[fqn]``.

    A tensor whose reference is below ``ZERO_GRADIENT_FRACTION`` of the largest of ``reference``
    is measured against that largest value (see the module docstring).

    Example::

        errors = errors_by_fqn(parallel_gradients, reference.gradients[0])
    """
    compared = list(reference if names is None else names)
    missing = sorted(set(compared) - set(parallel))
    if missing:
        raise AssertionError(f"the parallel run has no value for {missing[:5]} ({len(missing)} FQNs)")
    model_scale = max((tensor.detach().abs().max().item() for tensor in reference.values()), default=0.0)
    errors = {}
    for name in compared:
        expected = reference[name]
        own_scale = expected.detach().abs().max().item()
        scale = model_scale if own_scale < ZERO_GRADIENT_FRACTION * model_scale else None
        errors[name] = relative_error(parallel[name], expected, scale)
    return errors


def assert_close_by_fqn(
    parallel: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    bound: float,
    what: str = "gradient",
) -> float:
    """Fail unless every tensor of ``reference`` is matched within ``bound`` relative; return the worst error.

    The message names the worst FQN, its error and the next worst ones.

    Example::

        worst = assert_close_by_fqn(gradients, reference.gradients[0], 1e-6, "first-step gradient")
    """
    errors = errors_by_fqn(parallel, reference)
    ranked = sorted(errors.items(), key=lambda item: item[1], reverse=True)
    worst_name, worst = ranked[0]
    if not worst <= bound:
        others = ", ".join(f"{name} {error:.1e}" for name, error in ranked[1:4])
        raise AssertionError(
            f"{what} of {worst_name}: relative error {worst:.2e} > bound {bound:.1e} (next: {others})"
        )
    return worst


def max_relative_error(values: Sequence[float], reference: Sequence[float]) -> float:
    """The worst ``|value - reference| / |reference|`` over paired steps (lengths must match).

    Example::

        assert max_relative_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    """
    return max(
        abs(value - expected) / abs(expected) for value, expected in zip(values, reference, strict=True)
    )


def assert_losses_close(losses: Sequence[float], reference: Sequence[float], bound: float) -> float:
    """Fail unless every step's loss is within ``bound`` relative of the reference's; return the worst.

    Example::

        assert_losses_close(run_losses, reference.losses, 1e-4)
    """
    if len(losses) != len(reference):
        raise AssertionError(f"{len(losses)} losses against {len(reference)} reference steps")
    errors = [abs(loss - expected) / abs(expected) for loss, expected in zip(losses, reference, strict=True)]
    step = max(range(len(errors)), key=errors.__getitem__)
    if not errors[step] <= bound:
        raise AssertionError(
            f"loss of step {step}: {losses[step]!r} vs reference {reference[step]!r}, "
            f"relative error {errors[step]:.2e} > bound {bound:.1e}"
        )
    return errors[step]


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{fqn: full gradient}`` of every parameter that has one (DTensor gradients gathered).

    Example::

        gradients = full_gradients(model)   # on every rank, after backward
    """
    return {
        name: full_value(parameter.grad).clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }


def innermost_module(model: nn.Module) -> nn.Module:
    """The model inside its wrappers (each ``.module``: data parallel, pipeline), whose FQNs are
    the single-device model's.

    Example::

        before = full_parameters(innermost_module(parallel_model))   # "lm_head.weight", not "module.…"
    """
    inner = getattr(model, "module", None)
    while isinstance(inner, nn.Module):
        model = inner
        inner = getattr(model, "module", None)
    return model


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{fqn: full value}`` of every parameter (DTensors gathered: every rank must call it), by
    the FQNs of the model inside its wrappers (:func:`innermost_module`).

    Example::

        before = full_parameters(model); optimizer.step(); after = full_parameters(model)
    """
    inner = innermost_module(model)
    return {name: full_value(parameter).clone() for name, parameter in inner.named_parameters()}


def sgd_step_gradients(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], lr: float
) -> dict[str, torch.Tensor]:
    """The gradients one plain SGD step (no momentum, no weight decay) applied: (before - after) / lr.

    Reads the gradient an optimizer really stepped, whatever holds it in between (ZeRO
    shards, bucket views, pipeline stages); rounding adds ~ulp(parameter) / lr.

    Example::

        gradients = sgd_step_gradients(parameters_before, parameters_after, lr=1.0)
    """
    return {name: (before[name].double() - after[name].double()).div(lr).float() for name in after}


def gradient_errors(parallel: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Per parameter FQN, the relative error of the parallel gradient (see the module docstring).

    Example::

        worst = max(gradient_errors(model, reference).items(), key=lambda item: item[1])
    """
    reference_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    parallel_grads = {name: p.grad for name, p in parallel.named_parameters() if p.grad is not None}
    # A parameter the forward never reaches (BART's cross-attention in its causal LM) has no
    # gradient on either side; one with a gradient on one side only is an error either way.
    only_parallel = sorted(set(parallel_grads) - set(reference_grads))
    if only_parallel:
        raise AssertionError(
            f"the reference has no gradient for {only_parallel[:5]} ({len(only_parallel)} FQNs)"
        )
    return errors_by_fqn(parallel_grads, reference_grads)
