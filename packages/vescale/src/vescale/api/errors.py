"""The errors of the unified API: each says what is wrong and how to fix it.

Example::

    try:
        vescale.parallelize(plan, model)
    except vescale.api.errors.ParallelizeError as error:
        print(error)   # names the plan field, the model or the process group at fault
"""

from __future__ import annotations

__all__ = [
    "NotSingleDeviceWarning",
    "ParallelizeError",
    "PlanMismatchError",
    "UnsupportedPlanError",
    "VescaleAPIError",
    "WorldSizeError",
]


class VescaleAPIError(Exception):
    """The base of every error the unified API (``vescale.parallelize`` & co.) raises."""


class ParallelizeError(VescaleAPIError, ValueError):
    """``vescale.parallelize`` cannot apply the plan to this model or process group."""


class WorldSizeError(ParallelizeError):
    """The process group is missing or its size is not the plan's world size."""


class PlanMismatchError(ParallelizeError):
    """The plan names modules or shapes this model does not have (it was made for another model)."""


class UnsupportedPlanError(ParallelizeError):
    """The plan combines features that this version cannot run together yet (the message says which)."""


class NotSingleDeviceWarning(UserWarning):
    """A run computes other numbers than one device would, where veScale cannot avoid it (the
    message says what differs, where, and how to compare with one device)."""
