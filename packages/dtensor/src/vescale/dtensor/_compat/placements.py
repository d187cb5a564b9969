"""Placements and redistribution: the private placement class an InterleavedShard is stored
as, the Shard(i) -> Shard(j) step that vescale.dtensor.shard_alltoall replaces, and whether
PyTorch's LocalTensorMode is active.

Private PyTorch APIs: ``torch.distributed.tensor.placement_types._StridedShard`` (and its
``split_factor`` property), ``placement_types.Shard._to_new_shard_dim`` and
``torch.distributed._local_tensor.local_tensor_mode``.

PyTorch's own ``Shard._to_new_shard_dim`` is kept here once replaced
(``_original_shard_to_new_shard_dim``); read it through :func:`original_shard_to_new_shard_dim`.

Example::

    from vescale.dtensor._compat.placements import strided_shard_type
    strided_shard_type()(0, split_factor=3)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vescale.dtensor._compat.core import PrivateTorchAPIError, _private_attribute

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    class StridedShard(Placement):
        """For the type checker only: what vescale reads of PyTorch's private ``_StridedShard``
        (the class strided_shard_type() returns at run time)."""

        dim: int
        split_factor: int

        def __init__(self, dim: int, *, split_factor: int) -> None: ...


__all__ = [
    "SHARD_TO_NEW_SHARD_DIM_PARAMETERS",
    "local_tensor_mode_active",
    "original_shard_to_new_shard_dim",
    "set_shard_to_new_shard_dim",
    "strided_shard_type",
]


# --- placements and redistribution (vescale.dtensor.placements, .redistribute) ------------
# InterleavedShard: a DTensor stores veScale's InterleavedShard(dim, k) as PyTorch's private
# _StridedShard(dim, split_factor=k), whose layout on one mesh dim (cut the dim into k parts,
# then torch.chunk each part over the mesh dim) is the same; DTensor accepts no other type.


def strided_shard_type() -> type[StridedShard]:
    """PyTorch's ``_StridedShard`` placement class, the form a DTensor stores an InterleavedShard in."""
    strided_shard: type[StridedShard] = _private_attribute(
        "torch.distributed.tensor.placement_types", "_StridedShard", type
    )
    if not isinstance(getattr(strided_shard, "split_factor", None), property):
        raise PrivateTorchAPIError(
            "torch.distributed.tensor.placement_types._StridedShard has no split_factor property in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )
    return strided_shard


# Shard(i) -> Shard(j): DTensor's redistribution calls the private method
# Shard._to_new_shard_dim(local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim),
# which on a CPU mesh all-gathers the tensor; vescale.dtensor.shard_alltoall swaps in an
# all-to-all. PyTorch's own version stays reachable for the meshes it keeps (non-CPU, and
# LocalTensorMode, PyTorch's single-process simulation of ranks).

SHARD_TO_NEW_SHARD_DIM_PARAMETERS = (
    "self",
    "local_tensor",
    "mesh",
    "mesh_dim",
    "current_logical_shape",
    "new_shard_dim",
)
_original_shard_to_new_shard_dim: Any = None


def original_shard_to_new_shard_dim() -> Any:
    """PyTorch's own ``Shard._to_new_shard_dim`` (as it was before any replacement)."""
    if _original_shard_to_new_shard_dim is not None:
        return _original_shard_to_new_shard_dim
    shard_class = _private_attribute("torch.distributed.tensor.placement_types", "Shard", type)
    method = getattr(shard_class, "_to_new_shard_dim", None)
    code = getattr(method, "__code__", None)
    parameters = code.co_varnames[: code.co_argcount] if code is not None else ()
    if parameters != SHARD_TO_NEW_SHARD_DIM_PARAMETERS:
        raise PrivateTorchAPIError(
            "torch.distributed.tensor.placement_types.Shard._to_new_shard_dim is missing or takes "
            f"{parameters} in torch {torch.__version__}, expected {SHARD_TO_NEW_SHARD_DIM_PARAMETERS}; "
            "update vescale/dtensor/_compat/ and vescale/dtensor/shard_alltoall.py for this release."
        )
    return method


def set_shard_to_new_shard_dim(replacement: Any) -> None:
    """Make ``Shard._to_new_shard_dim`` be ``replacement`` (idempotent; the original is kept)."""
    global _original_shard_to_new_shard_dim
    original = original_shard_to_new_shard_dim()
    _original_shard_to_new_shard_dim = original
    shard_class = _private_attribute("torch.distributed.tensor.placement_types", "Shard", type)
    shard_class._to_new_shard_dim = replacement


def local_tensor_mode_active() -> bool:
    """Whether PyTorch's ``LocalTensorMode`` (ranks simulated in one process) is active."""
    return _private_attribute("torch.distributed._local_tensor", "local_tensor_mode", None)() is not None
