"""``save(..., async_save=True, defer_copies=True)``: parameters and optimizer state are copied on
the saving thread, while training goes on.

The first async save of a process blocks for 29-51% of a step: its staging memory is fresh,
and faulting it in while copying costs far more than the copy itself. In training, parameters
and optimizer state change only when an optimizer steps, so their copies need not be taken
before ``save()`` returns: with ``defer_copies`` they are taken on the saving thread, before
it writes, and every optimizer's ``step()`` in the process first waits for them (a global
optimizer step pre-hook). The forward and backward passes of the next training step run
meanwhile. Everything else (module buffers, which a forward may update, and tensors in other
objects) is still copied before ``save()`` returns.

Example::

    state = {"model": model, "optimizer": optimizer}
    pending = save("ckpt/step-000100", state, async_save=True, defer_copies=True)
    loss = model(batch).loss; loss.backward()   # runs while the parameters are being copied
    optimizer.step()                           # waits for the copies, if they are not done yet
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["DeferredCopies", "deferrable_names", "wait_for_deferred_copies"]

_in_flight: DeferredCopies | None = None
_hook_registered = False
_registration_lock = threading.Lock()


def deferrable_names(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> frozenset[str]:
    """The names in ``tensors`` (from ``flatten_state(state)``) that only an optimizer step changes:
    modules' parameters and optimizers' state.

    Example::

        deferrable_names({"model": model, "optimizer": optimizer}, tensors)  # "model/fc.weight", ...
    """
    names: set[str] = set()
    prefixes = []
    for key, value in state.items():
        if isinstance(value, nn.Module):
            names.update(f"{key}/{fqn}" for fqn, _ in value.named_parameters())
        elif isinstance(value, torch.optim.Optimizer):
            prefixes.append(f"{key}/")
    if prefixes:
        names.update(name for name in tensors if name.startswith(tuple(prefixes)))
    return frozenset(name for name in names if name in tensors)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    wait_for_deferred_copies()


def wait_for_deferred_copies() -> None:
    """Block until the copies of the async save in flight (if any) are taken."""
    copies = _in_flight
    if copies is not None:
        copies.wait()


class DeferredCopies:
    """``(staging piece, live source)`` pairs to copy on the saving thread; optimizer steps wait for them.

    Example::

        copies = DeferredCopies([(piece, param.detach())])
        copies.run()            # on the saving thread
    """

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        global _in_flight, _hook_registered
        self._copies = copies
        self._done = threading.Event()
        self.seconds = 0.0
        # Registered once and never removed: removing a hook while a step iterates the hooks fails.
        with _registration_lock:
            if not _hook_registered:
                register_optimizer_step_pre_hook(_before_optimizer_step)
                _hook_registered = True
        _in_flight = self

    def wait(self) -> None:
        """Block until :meth:`run` has taken every copy (or failed)."""
        self._done.wait()

    def run(self) -> None:
        """Take the copies (on the saving thread); optimizer steps go on once they are taken."""
        global _in_flight
        started = time.perf_counter()
        try:
            with torch.no_grad():
                for piece, source in self._copies:
                    piece.copy_(source)
        finally:
            self._copies = []
            self.seconds = time.perf_counter() - started
            self._done.set()
            if _in_flight is self:
                _in_flight = None
