"""Gradient synchronisation of DTensor parameters: the protocol that dmodule registers and
the optimizers drive.

A parameter's gradient can come out of backward in a placement other than the
parameter's: most often ``Partial(sum)`` for a Replicate parameter whose activations are
sharded (a norm weight under sequence parallelism, anything a plan leaves Replicate next to
sharded inputs). Until it is reduced, every rank holds a different part of the sum, and an
optimizer step would silently diverge between ranks. :class:`GradSync` watches the
parameters, notes each gradient that arrives in another placement, and redistributes them
all to their parameter's placements at the end of the backward pass (``automatic=True``,
the default) or when :meth:`GradSync.finish_grad_sync` is called. Optimizers (vescale's own,
or a data-parallel wrapper) call :func:`finish_grad_sync` on the module before reading
gradients; with nothing pending it is a no-op.

Example::

    sync = attach_grad_sync(model)            # dmodule does this in parallelize_module
    model(input_ids).loss.backward()          # the Partial norm gradients are all-reduced at the end
    finish_grad_sync(model)                   # explicit control: reduces whatever is still pending
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vescale.dtensor import _compat

__all__ = ["GRAD_SYNC_ATTRIBUTE", "GradSync", "attach_grad_sync", "finish_grad_sync", "grad_sync_of"]

# A module that has a GradSync carries it under this attribute.
GRAD_SYNC_ATTRIBUTE = "_vescale_grad_sync"


class GradSync:
    """Reduce gradients that arrive in a placement other than their DTensor parameter's.

    Example::

        sync = GradSync(model.parameters())
        loss.backward()
        assert not sync.pending()
    """

    def __init__(self, parameters: Iterable[nn.Parameter], *, automatic: bool = True) -> None:
        self.automatic = automatic
        self._pending: dict[int, nn.Parameter] = {}
        self._callback_queued = False
        unique = {id(parameter): parameter for parameter in parameters if isinstance(parameter, DTensor)}
        # A frozen parameter (AFMoE's expert-load bias) takes no hook; should it be unfrozen later,
        # its gradient is reduced with the others' at the end of backward (finish_grad_sync).
        self._frozen = [parameter for parameter in unique.values() if not parameter.requires_grad]
        self._hook_handles = [
            parameter.register_post_accumulate_grad_hook(self._on_gradient)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            for parameter in unique.values()
            if parameter.requires_grad
        ]

    def pending(self) -> list[nn.Parameter]:
        """The parameters whose gradients still wait for their reduction."""
        return list(self._pending.values())

    def finish_grad_sync(self) -> None:
        """Redistribute every pending gradient to its parameter's placements (collectives run here)."""
        pending, self._pending = self._pending, {}
        pending.update({id(parameter): parameter for parameter in self._frozen if parameter.grad is not None})
        with torch.no_grad():
            for parameter in pending.values():
                grad = parameter.grad
                watched = cast(DTensor, parameter)  # __init__ watches DTensor parameters only
                if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(watched.placements):
                    parameter.grad = grad.redistribute(watched.device_mesh, watched.placements)

    def remove(self) -> None:
        """Stop watching the parameters (pending gradients stay as they are)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _on_gradient(self, parameter: Any) -> None:
        grad = parameter.grad
        if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(parameter.placements):
            return
        self._pending[id(parameter)] = parameter
        if self.automatic and not self._callback_queued:
            self._callback_queued = True
            _compat.queue_autograd_engine_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.finish_grad_sync()


def attach_grad_sync(module: nn.Module, *, automatic: bool = True) -> GradSync:
    """Watch ``module``'s DTensor parameters (once: a second call returns the same GradSync).

    Example::

        attach_grad_sync(model, automatic=False)   # a data-parallel wrapper reduces when it chooses
    """
    existing = grad_sync_of(module)
    if existing is not None:
        existing.automatic = automatic
        return existing
    sync = GradSync(module.parameters(), automatic=automatic)
    setattr(module, GRAD_SYNC_ATTRIBUTE, sync)
    return sync


def grad_sync_of(module: nn.Module) -> GradSync | None:
    """The GradSync attached to ``module``, if any."""
    return getattr(module, GRAD_SYNC_ATTRIBUTE, None)


def finish_grad_sync(module: nn.Module) -> None:
    """Reduce the pending gradients of ``module`` and of every submodule that has a GradSync.

    Example::

        loss.backward(); finish_grad_sync(model); optimizer.step()
    """
    for submodule in module.modules():
        sync = grad_sync_of(submodule)
        if sync is not None:
            sync.finish_grad_sync()
