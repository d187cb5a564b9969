"""The private PyTorch APIs that ``vescale.doptim`` relies on, confined to this module.

Gradient buckets must be waited for when the backward pass ends, and PyTorch offers no
public end-of-backward hook; autograd's engine has ``queue_callback``. Each accessor names
the private attribute it reads, and ``tests/test_doptim_compat.py`` fails loudly when a
PyTorch release renames or removes one.

Example::

    from vescale.doptim import _compat
    _compat.queue_end_of_backward_callback(lambda: print("backward finished"))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["MIN_TORCH", "TESTED_TORCH", "PrivateTorchAPIError", "queue_end_of_backward_callback"]

MIN_TORCH = (2, 11)
# The newest release these private attributes were checked against.
TESTED_TORCH = (2, 13)


class PrivateTorchAPIError(RuntimeError):
    """A private PyTorch attribute that vescale.doptim relies on is missing or changed."""


class _AutogradEngine(Protocol):
    def queue_callback(self, callback: Callable[[], None]) -> None: ...


def _autograd_engine() -> _AutogradEngine:
    engine: _AutogradEngine | None = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not callable(getattr(engine, "queue_callback", None)):
        raise PrivateTorchAPIError(
            "torch.autograd.Variable._execution_engine.queue_callback is missing in torch "
            f"{torch.__version__}; vescale.doptim was checked against torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to "
            f"{TESTED_TORCH[0]}.{TESTED_TORCH[1]}. Install a torch in that range, or update "
            "vescale/doptim/_compat.py for this release."
        )
    return engine


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` once the backward pass now executing finishes (call it during backward)."""
    _autograd_engine().queue_callback(callback)
