"""veScale's layer on PyTorch DTensor: named meshes, extra placements, operator coverage,
single-device random numbers, communication accounting, and the multi-process test
harness (:mod:`vescale.dtensor.testing`).

PyTorch's own types are re-exported unchanged, so a ``vescale.dtensor.DTensor`` is a
``torch.distributed.tensor.DTensor``.

Example::

    from vescale.dtensor import Shard, distribute_tensor, init_mesh
    mesh = init_mesh(dp=2, tp=2)
    weight = distribute_tensor(torch.randn(8, 8), mesh, [Replicate(), Shard(0)])
"""

from importlib.metadata import version as _distribution_version

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from vescale.dtensor.errors import DTensorError, MeshError
from vescale.dtensor.mesh import MESH_DIM_ORDER, device_type_for_backend, init_mesh

__all__ = [
    "MESH_DIM_ORDER",
    "DTensor",
    "DTensorError",
    "DeviceMesh",
    "MeshError",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "__version__",
    "device_type_for_backend",
    "distribute_tensor",
    "from_local",
    "init_mesh",
]

__version__ = _distribution_version("vescale-dtensor")

from_local = DTensor.from_local
