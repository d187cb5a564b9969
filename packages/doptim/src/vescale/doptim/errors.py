"""The exceptions of ``vescale.doptim``.

Each one is also the built-in exception of the matching kind (``DataParallelMeshError`` is a
``ValueError``), so callers that catch the built-in keep working.

Example::

    try:
        DDP(model, init_mesh(tp=2))
    except DataParallelMeshError as error:
        print(error)   # names the mesh dims and the one that is missing
"""

from __future__ import annotations

__all__ = [
    "DOptimError",
    "DataParallelConfigError",
    "DataParallelMeshError",
    "OptimizerOrderError",
]


class DOptimError(Exception):
    """Base class of the data-parallel and ZeRO errors."""


class DataParallelMeshError(DOptimError, ValueError):
    """A mesh dim that is not in the mesh, or a parameter on another mesh than the data-parallel one."""


class OptimizerOrderError(DOptimError, RuntimeError):
    """An optimizer built or stepped before the data-parallel stage was applied to its model."""


class DataParallelConfigError(DOptimError, ValueError):
    """An impossible setting: a ZeRO stage out of range, a bucket size below zero, an unsupported mix."""
