"""DTensor op handlers that split an interleaved-sharded tensor into its parts, and join parts
back, without communication.

A DTensor with ``_StridedShard(dim, split_factor=k)`` on one mesh dim (veScale's
``InterleavedShard(dim, k)``) holds ``part_0_r|part_1_r|...`` locally. PyTorch's sharding rule
for ``split`` unshards the split dim (an all-gather); but when every split size is a whole
number of parts, each output is made of whole parts, and its local shard is a contiguous
slice of the local tensor: one part is an ordinary ``Shard(dim)``, ``g`` parts are
``_StridedShard(dim, g)``. ``cat`` of such pieces along ``dim`` (how autograd joins the
gradients of a ``split``) is the inverse, again local. ``chunk`` reaches DTensor as
``split``; ``view``/``unflatten`` into ``(k, part)`` already give ``Shard`` in PyTorch.

Any other call (no interleaved sharding on that dim, sizes not aligned with the parts)
goes on to DTensor's own dispatch through :func:`vescale.dtensor._op_handlers.dispatch_previous`.

Example::

    register_interleaved_ops()
    q, k, v = qkv.split(hidden_size, dim=-1)    # qkv: _StridedShard(-1, 3) -> three Shard(-1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Shard

from vescale.dtensor import _compat
from vescale.dtensor._op_handlers import OpHandler, dispatch_previous, register_op_handlers

__all__ = ["INTERLEAVED_OPS", "register_interleaved_ops"]

aten = torch.ops.aten
# Resolved once: the handlers below run on every split/cat of a DTensor.
_STRIDED_SHARD = _compat.strided_shard_type()


def _parts_on(placement: Placement, dim: int, ndim: int) -> int | None:
    """How many whole parts of tensor dim ``dim`` a placement cuts: 1 for Shard, k for strided."""
    if isinstance(placement, _STRIDED_SHARD) and placement.dim % ndim == dim:
        return int(placement.split_factor)
    if isinstance(placement, Shard) and placement.dim % ndim == dim:
        return 1
    return None


def _sole_sharding_mesh_dim(dtensor: DTensor, dim: int) -> tuple[int, int] | None:
    """``(mesh_dim, parts)`` when exactly one mesh dim shards tensor dim ``dim``, else None."""
    sharding = [
        (mesh_dim, parts)
        for mesh_dim, placement in enumerate(dtensor.placements)
        if (parts := _parts_on(placement, dim, dtensor.ndim)) is not None
    ]
    if len(sharding) != 1 or dtensor.device_mesh.get_coordinate() is None:
        return None
    return sharding[0]


def _with_parts(placements: Sequence[Placement], mesh_dim: int, dim: int, parts: int) -> list[Placement]:
    with_parts = list(placements)
    with_parts[mesh_dim] = Shard(dim) if parts == 1 else _STRIDED_SHARD(dim, split_factor=parts)
    return with_parts


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _split_handler(op_call: Any, args: tuple, kwargs: dict) -> object:
    source, split_size_or_sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not isinstance(source, DTensor) or source.ndim == 0:
        return dispatch_previous(op_call, args, kwargs)
    dim %= source.ndim
    sharding = _sole_sharding_mesh_dim(source, dim)
    dim_size = source.shape[dim]
    if sharding is None or sharding[1] < 2 or dim_size % sharding[1]:
        return dispatch_previous(op_call, args, kwargs)
    mesh_dim, parts = sharding
    part_size = dim_size // parts
    if isinstance(split_size_or_sizes, int):
        sizes = [
            min(split_size_or_sizes, dim_size - start) for start in range(0, dim_size, split_size_or_sizes)
        ]
    else:
        sizes = list(split_size_or_sizes)
    if part_size == 0 or any(size % part_size for size in sizes):
        return dispatch_previous(op_call, args, kwargs)
    local = source.to_local()
    local_part_size = local.size(dim) // parts
    local_pieces = local.split([size // part_size * local_part_size for size in sizes], dim)
    pieces = []
    for size, local_piece in zip(sizes, local_pieces, strict=True):
        shape = list(source.shape)
        shape[dim] = size
        placements = _with_parts(source.placements, mesh_dim, dim, size // part_size)
        pieces.append(
            DTensor.from_local(
                local_piece,
                source.device_mesh,
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=source.stride(),
            )
        )
    return pieces


def _cat_handler(op_call: Any, args: tuple, kwargs: dict) -> object:
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0] if tensors else None
    if len(tensors) < 2 or not all(isinstance(tensor, DTensor) for tensor in tensors) or first.ndim == 0:
        return dispatch_previous(op_call, args, kwargs)
    dim %= first.ndim
    shardings = [_sole_sharding_mesh_dim(tensor, dim) for tensor in tensors]
    if any(sharding is None or sharding[0] != shardings[0][0] for sharding in shardings):
        return dispatch_previous(op_call, args, kwargs)
    mesh_dim = shardings[0][0]
    part_sizes = {
        divmod(tensor.shape[dim], parts) for tensor, (_, parts) in zip(tensors, shardings, strict=True)
    }
    other_placements = {tuple(_with_parts(tensor.placements, mesh_dim, dim, 1)) for tensor in tensors}
    other_sizes = {tuple(size for d, size in enumerate(tensor.shape) if d != dim) for tensor in tensors}
    part_size, remainder = next(iter(part_sizes))
    joinable = (
        len(part_sizes) == 1
        and part_size >= 1
        and remainder == 0
        and len(other_placements) == 1
        and len(other_sizes) == 1
        and all(tensor.device_mesh == first.device_mesh and tensor.ndim == first.ndim for tensor in tensors)
    )
    if not joinable:
        return dispatch_previous(op_call, args, kwargs)
    local = torch.cat([tensor.to_local() for tensor in tensors], dim)
    shape = list(first.shape)
    shape[dim] = sum(tensor.shape[dim] for tensor in tensors)
    total_parts = sum(parts for _, parts in shardings)
    return DTensor.from_local(
        local,
        first.device_mesh,
        _with_parts(first.placements, mesh_dim, dim, total_parts),
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


INTERLEAVED_OPS: dict[Any, OpHandler] = {
    aten.split.Tensor: _split_handler,
    aten.split_with_sizes.default: _split_handler,
    aten.cat.default: _cat_handler,
}


def register_interleaved_ops() -> None:
    """Install the handlers in DTensor's op table (idempotent), keeping any handler they replace.

    Example::

        register_interleaved_ops()
        parts = interleaved.chunk(3, dim=0)   # three Shard(0) DTensors, no all-gather
    """
    register_op_handlers(INTERLEAVED_OPS)
