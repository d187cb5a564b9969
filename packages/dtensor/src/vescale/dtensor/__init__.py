"""veScale's layer on PyTorch DTensor: named meshes, extra placements, operator coverage,
single-device random numbers, communication accounting, deferred initialisation, and the
multi-process test harness (:mod:`vescale.dtensor.testing`).

PyTorch's own types are re-exported unchanged, so a ``vescale.dtensor.DTensor`` is a
``torch.distributed.tensor.DTensor``. ``distribute_tensor``, ``from_local`` and
``redistribute`` are veScale's: they also take :class:`InterleavedShard` and the short
placement strings (``"S(0)"``, ``"R"``).

veScale's names load on first use, and using any of them installs veScale's operator
coverage into DTensor (the sharding strategies of :mod:`vescale.dtensor.ops`, and
Shard(i)→Shard(j) as one all-to-all on every backend). Importing this package alone changes
nothing in PyTorch.

Example::

    from vescale.dtensor import distribute_tensor, init_mesh, manual_seed
    mesh = init_mesh(dp=2, tp=2)
    manual_seed(0)                                     # single-device random numbers
    weight = distribute_tensor(torch.randn(8, 8), mesh, ["R", "S(0)"])
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _distribution_version
from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from vescale.dtensor.errors import DTensorError, MeshError

if TYPE_CHECKING:
    from vescale.dtensor.comm import CommAccountingError, CommCounter, bytes_moved
    from vescale.dtensor.debug import DTensorOpLogger, log_dtensor_ops
    from vescale.dtensor.deferred import (
        DeferredInitError,
        deferred_init,
        is_deferred,
        materialize_module,
        materialize_tensor,
    )
    from vescale.dtensor.grad_sync import GradSync, finish_grad_sync
    from vescale.dtensor.implicit_replication import ImplicitReplicationError, implicit_replication_scope
    from vescale.dtensor.mesh import MESH_DIM_ORDER, device_type_for_backend, init_mesh
    from vescale.dtensor.ops import OpCoverageRecorder, OpCoverageReport
    from vescale.dtensor.placements import (
        InterleavedShard,
        PlacementError,
        distribute_tensor,
        from_local,
        placement_from_string,
        placement_to_string,
        redistribute,
    )
    from vescale.dtensor.random import RandomOpError, manual_seed

# veScale's public names and the module each lives in.
_LAZY_NAMES = {
    "MESH_DIM_ORDER": "vescale.dtensor.mesh",
    "device_type_for_backend": "vescale.dtensor.mesh",
    "init_mesh": "vescale.dtensor.mesh",
    "InterleavedShard": "vescale.dtensor.placements",
    "PlacementError": "vescale.dtensor.placements",
    "distribute_tensor": "vescale.dtensor.placements",
    "from_local": "vescale.dtensor.placements",
    "redistribute": "vescale.dtensor.placements",
    "placement_from_string": "vescale.dtensor.placements",
    "placement_to_string": "vescale.dtensor.placements",
    "RandomOpError": "vescale.dtensor.random",
    "manual_seed": "vescale.dtensor.random",
    "ImplicitReplicationError": "vescale.dtensor.implicit_replication",
    "implicit_replication_scope": "vescale.dtensor.implicit_replication",
    "OpCoverageRecorder": "vescale.dtensor.ops",
    "OpCoverageReport": "vescale.dtensor.ops",
    "CommCounter": "vescale.dtensor.comm",
    "CommAccountingError": "vescale.dtensor.comm",
    "bytes_moved": "vescale.dtensor.comm",
    "DTensorOpLogger": "vescale.dtensor.debug",
    "log_dtensor_ops": "vescale.dtensor.debug",
    "GradSync": "vescale.dtensor.grad_sync",
    "finish_grad_sync": "vescale.dtensor.grad_sync",
    "DeferredInitError": "vescale.dtensor.deferred",
    "deferred_init": "vescale.dtensor.deferred",
    "is_deferred": "vescale.dtensor.deferred",
    "materialize_module": "vescale.dtensor.deferred",
    "materialize_tensor": "vescale.dtensor.deferred",
}

__all__ = [
    "MESH_DIM_ORDER",
    "CommAccountingError",
    "CommCounter",
    "DTensor",
    "DTensorError",
    "DTensorOpLogger",
    "DeferredInitError",
    "DeviceMesh",
    "GradSync",
    "ImplicitReplicationError",
    "InterleavedShard",
    "MeshError",
    "OpCoverageRecorder",
    "OpCoverageReport",
    "Partial",
    "Placement",
    "PlacementError",
    "RandomOpError",
    "Replicate",
    "Shard",
    "__version__",
    "bytes_moved",
    "deferred_init",
    "device_type_for_backend",
    "distribute_tensor",
    "finish_grad_sync",
    "from_local",
    "implicit_replication_scope",
    "init_mesh",
    "is_deferred",
    "log_dtensor_ops",
    "manual_seed",
    "materialize_module",
    "materialize_tensor",
    "placement_from_string",
    "placement_to_string",
    "redistribute",
]

__version__ = _distribution_version("vescale-dtensor")


def __getattr__(name: str) -> Any:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'vescale.dtensor' has no attribute {name!r}")
    importlib.import_module("vescale.dtensor.ops")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
