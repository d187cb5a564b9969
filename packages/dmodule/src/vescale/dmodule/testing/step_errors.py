"""One training step of a parallelized causal LM beside its single-process reference, and its check.

The reference is a copy of the model taken before ``parallelize_module``, trained in this process
on the same batch (float32); compared are the loss and every parameter's gradient, as relative
errors (:mod:`vescale.dtensor.testing.numerics`).

Example::

    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, auto_sharding_plan(model))
    errors = step_errors(model, reference, input_ids, labels)
    assert_step_errors_within(errors, loss_rtol=1e-5, grad_rtol=1e-4, where="rank 0")
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from vescale.dtensor.testing.numerics import gradient_errors, relative_error

__all__ = ["assert_step_errors_within", "step_errors"]


def step_errors(
    model: nn.Module, reference: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
) -> dict[str, Any]:
    """Forward and backward of ``model`` and of ``reference`` on the same batch (``transformers``
    causal LMs): ``{"loss_error": float, "grad_errors": {fqn: float}}``.

    Example::

        errors = step_errors(model, reference, input_ids, labels)
        worst = max(errors["grad_errors"].values())
    """
    # As training calls them (vescale.parallelize does the same): without a key/value cache.
    batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    if "use_cache" in inspect.signature(reference.forward).parameters:
        batch["use_cache"] = False
    loss = model(**batch).loss
    loss.backward()
    reference_loss = reference(**batch).loss
    reference_loss.backward()
    return {
        "loss_error": relative_error(loss, reference_loss),
        "grad_errors": gradient_errors(model, reference),
    }


def assert_step_errors_within(errors: dict[str, Any], loss_rtol: float, grad_rtol: float, where: str) -> None:
    """Raise ``AssertionError`` naming ``where`` (and the worst parameter) when :func:`step_errors`'
    loss error exceeds ``loss_rtol`` or a gradient's exceeds ``grad_rtol``.

    Example::

        assert_step_errors_within(errors, 1e-5, 1e-4, where=f"rank {rank}, sequence_parallel=True")
    """
    if errors["loss_error"] > loss_rtol:
        raise AssertionError(f"{where}: loss error {errors['loss_error']:.2e} > {loss_rtol:.0e}")
    worst = max(errors["grad_errors"], key=errors["grad_errors"].get)
    if errors["grad_errors"][worst] > grad_rtol:
        raise AssertionError(
            f"{where}: gradient of {worst} off by {errors['grad_errors'][worst]:.2e} > {grad_rtol:.0e}"
        )
