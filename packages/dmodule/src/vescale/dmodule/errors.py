"""The exceptions of ``vescale.dmodule``.

Each is also the built-in exception of the matching kind (a ``ShardingPlanError`` is a
``ValueError``), so callers that catch the built-in keep working.

Example::

    try:
        ShardingPlan.from_dict({"parameters": {}})
    except ShardingPlanError as error:
        print(error)   # unknown plan key 'parameters'; did you mean 'parameter'?
"""

from __future__ import annotations

__all__ = ["DModuleError", "ShardingPlanError"]


class DModuleError(Exception):
    """Base class of the errors raised by ``vescale.dmodule``."""


class ShardingPlanError(DModuleError, ValueError):
    """A sharding plan is malformed, names no module, or asks for an impossible placement."""
