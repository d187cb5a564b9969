"""How parallel results are compared with their single-process reference.

GUIDE §4's measure is the relative error ‖parallel − reference‖∞ / ‖reference‖∞. A few
gradients are zero in exact arithmetic (a key-projection bias: softmax ignores a shift
shared by every key), so their reference is rounding noise and a relative error against
it means nothing: a gradient whose reference is below ``ZERO_GRADIENT_FRACTION`` of the
model's largest gradient is measured against that largest gradient instead.

Example::

    errors = gradient_errors(parallel_model, reference_model)   # {fqn: relative error}
    assert max(errors.values()) <= 1e-4
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ZERO_GRADIENT_FRACTION", "full_value", "gradient_errors", "relative_error"]

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


def gradient_errors(parallel: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Per parameter FQN, the relative error of the parallel gradient (see the module docstring).

    Example::

        worst = max(gradient_errors(model, reference).items(), key=lambda item: item[1])
    """
    reference_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    model_scale = max(grad.abs().max().item() for grad in reference_grads.values())
    errors = {}
    for name, parameter in parallel.named_parameters():
        reference_grad = reference_grads[name]
        own_scale = reference_grad.abs().max().item()
        scale = model_scale if own_scale < ZERO_GRADIENT_FRACTION * model_scale else None
        errors[name] = relative_error(parameter.grad, reference_grad, scale)
    return errors
