"""A loss whose ``backward()`` does nothing, for calls that already ran the backward pass.

A pipeline schedule (and any call that runs forward and backward over micro-batches itself)
returns the whole batch's loss; the user's unchanged ``loss.backward()`` must then be a no-op.
A factor on that loss before its backward (``(loss / k).backward()`` to accumulate ``k`` calls, a
``GradScaler``'s scale) cannot reach gradients that already exist: one device would have
scaled them, so it is a :class:`~vescale.dpipe.errors.ScaledLossError` that says what to do,
not gradients ``k`` times too large.

Example::

    loss = loss_with_backward_done(anchor, whole_batch_loss)   # anchor: any tensor requiring grad
    loss.backward()                                              # returns at once, grads untouched
"""

from __future__ import annotations

from typing import Any

import torch

from vescale.dpipe.errors import ScaledLossError

__all__ = ["loss_with_backward_done"]


class _BackwardAlreadyRan(torch.autograd.Function):
    """Identity on the loss whose backward stops at ``anchor``: nothing upstream receives a gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        # No gradient reached the result (another such loss around this one, as vescale.parallelize
        # puts on a pipeline's): backward gets None, not a zero to take for a factor.
        ctx.set_materialize_grads(False)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor | None) -> tuple[None, None]:
        if grad_loss is not None and not bool((grad_loss == 1).all()):
            factor = grad_loss.reshape(-1)[0].item()
            raise ScaledLossError(
                f"the loss was scaled by {factor:g} before backward() (loss / k to accumulate k calls, or "
                "a GradScaler), but its backward already ran inside the call (micro-batches, or a "
                "pipeline schedule), unscaled: the factor cannot reach the gradients. Call "
                "loss.backward() on the loss as returned; to accumulate, raise global_batch_size "
                "instead (the model splits it into micro-batches itself) and step once per call; for "
                "mixed precision use bf16, which needs no loss scaling"
            )
        return None, None


def loss_with_backward_done(anchor: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``loss``'s value, requiring grad through ``anchor``, with a backward that does nothing."""
    # torch leaves Function.apply unannotated.
    result: torch.Tensor = _BackwardAlreadyRan.apply(anchor, loss)  # type: ignore[no-untyped-call]
    return result
