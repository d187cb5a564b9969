"""A loss whose ``backward()`` does nothing, for calls that already ran the backward pass.

A pipeline schedule (and any call that runs forward and backward over micro-batches itself)
returns the whole batch's loss; the user's unchanged ``loss.backward()`` must then be a no-op.

Example::

    loss = loss_with_backward_done(anchor, whole_batch_loss)   # anchor: any tensor requiring grad
    loss.backward()                                              # returns at once, grads untouched
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["loss_with_backward_done"]


class _BackwardAlreadyRan(torch.autograd.Function):
    """Identity on the loss whose backward stops at ``anchor``: nothing upstream receives a gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[None, None]:
        return None, None


def loss_with_backward_done(anchor: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``loss``'s value, requiring grad through ``anchor``, with a backward that does nothing."""
    # torch leaves Function.apply unannotated.
    result: torch.Tensor = _BackwardAlreadyRan.apply(anchor, loss)  # type: ignore[no-untyped-call]
    return result
