"""The exceptions of deferred initialisation.

Example::

    try:
        materialize_module(torch.nn.Linear(2, 2))
    except NotDeferredError as error:
        print(error)   # names the module and says to build it with deferred_init(...)
"""

from __future__ import annotations

from vescale.dtensor.errors import DTensorError

__all__ = ["DeferredInitError", "DeferredPlacementError", "NotDeferredError"]


class DeferredInitError(DTensorError, RuntimeError):
    """A module cannot be constructed deferred, or a deferred tensor cannot be materialised."""


class NotDeferredError(DeferredInitError, TypeError):
    """A module or tensor handed to materialisation was not built by ``deferred_init``."""


class DeferredPlacementError(DeferredInitError, ValueError):
    """The placements asked for a deferred parameter or buffer cannot lay it out."""
