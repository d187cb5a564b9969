"""Which redistributions and strategies veScale plans itself, as predicates over DTensor specs.

``vescale.dtensor._compat`` wraps torch's redistribution planner and strategy selection with
these (the batch mesh dims hold each rank's own data under a Replicate placement, and torch's
search over every mesh dim is slow on meshes of three dims). They read only a spec's mesh and
placements.

Example::

    if moves_an_unchanged_replicate_dim(plan, src_spec, dst_spec):
        plan = planner.generate_greedy_transform_infos(src_spec, dst_spec)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.tensor import Replicate, Shard

__all__ = [
    "BATCH_MESH_DIMS",
    "inner_local_shape",
    "keeps_dims_replicate",
    "leaves_a_batch_dim",
    "moves_an_unchanged_replicate_dim",
    "nested_strided_dims",
    "one_dim_among_replicate_ones",
    "through_replicate",
]

BATCH_MESH_DIMS = ("dp", "ep", "pp")
"""Mesh dims over which each rank holds its own part of the batch (Replicate: same module, not same data)."""


def moves_an_unchanged_replicate_dim(transform_infos: list[Any], src_spec: Any, dst_spec: Any) -> bool:
    """Whether a plan moves data across a mesh dim on which the tensor is Replicate before and after."""
    unchanged = {
        dim
        for dim, (source, target) in enumerate(zip(src_spec.placements, dst_spec.placements, strict=True))
        if source.is_replicate() and target.is_replicate()
    }
    return any(info.mesh_dim in unchanged for info in transform_infos)


def one_dim_among_replicate_ones(src_spec: Any, dst_spec: Any) -> bool:
    """Whether a move on a mesh of several dims changes one dim, the tensor Replicate on every other.

    torch plans every move that involves a ``_StridedShard`` by a search over the placements of
    all mesh dims, whose cost grows with the mesh's dims and which is cached per tensor shape: a
    tensor-parallel MoE layer (a new shape per expert's token count) on a pp x dp x tp mesh spent
    0.66 s per plan, minutes per step. With one dim to move, the greedy plan moves just it.
    """
    placements = list(zip(src_spec.placements, dst_spec.placements, strict=True))
    changed = [source != target for source, target in placements]
    others_replicate = all(
        source.is_replicate() and target.is_replicate()
        for (source, target), moves in zip(placements, changed, strict=True)
        if not moves
    )
    return len(placements) > 1 and sum(changed) == 1 and others_replicate


def leaves_a_batch_dim(src_spec: Any, dst_spec: Any) -> bool:
    """Whether a move takes a tensor off Replicate on a batch mesh dim (dp, ep, pp).

    Sharding propagation prices every candidate strategy of an op, including ones that shard
    over the batch dims, which ``_compat.install_batch_dims_strategy_guard`` then turns down (they
    would split two ranks' different batches). Priced by torch's search over a pp x dp x tp mesh,
    each such candidate took up to a second; the greedy plan prices it at once.
    """
    names = src_spec.mesh.mesh_dim_names
    return names is not None and any(
        name in BATCH_MESH_DIMS and source.is_replicate() and not target.is_replicate()
        for name, source, target in zip(names, src_spec.placements, dst_spec.placements, strict=True)
    )


def keeps_dims_replicate(op_spec: Any, dims: list[int]) -> bool:
    """Whether a strategy keeps every input and output Replicate on the mesh dims ``dims``."""
    outputs = op_spec.output_specs
    specs = [*(op_spec.input_specs or ()), *(outputs if isinstance(outputs, tuple) else (outputs,))]
    return all(spec is None or spec.placements[dim].is_replicate() for spec in specs for dim in dims)


def through_replicate(transform_infos: list[Any], strided_shard: type) -> list[Any]:
    """The steps, with each move torch 2.11 cannot make in one step (``_StridedShard`` to or from
    ``Shard``, ``Partial`` to ``_StridedShard``) made in two, through ``Replicate``.

    ``strided_shard`` is torch's private ``_StridedShard`` class (``_compat.strided_shard_type()``).
    """
    steps = []
    for info in transform_infos:
        current, target = info.src_dst_placements
        to_strided = isinstance(target, strided_shard) and not isinstance(current, strided_shard)
        strided_to_shard = isinstance(current, strided_shard) and type(target) is Shard
        if (to_strided and not current.is_replicate()) or strided_to_shard:
            steps.append(dataclasses.replace(info, src_dst_placements=(current, Replicate())))
            steps.append(dataclasses.replace(info, src_dst_placements=(Replicate(), target)))
        else:
            steps.append(info)
    return steps


def nested_strided_dims(spec: Any, strided_shard: Any) -> tuple[int, int] | None:
    """``(outer, inner)`` mesh dims where FSDP2 strided-shards a tensor dim over an interleaved one.

    FSDP2 shards a tensor-parallel parameter over dp *within* each tp shard: it cuts each rank's
    local tensor along the dim tp shards and records ``_StridedShard(d, sf=tp)`` on dp. When
    the tp placement is itself a ``_StridedShard`` of that dim (an ``InterleavedShard``: GPT-2's
    fused ``c_attn`` bias ``IS(0,3)``), ``(dp, tp) = (_StridedShard(0, sf=2), _StridedShard(0,
    sf=3))``, and torch's redistribution reads it as another layout than the one the ranks hold
    (``full_tensor()`` of that bias came back scrambled). What the ranks hold is a plain
    ``Shard(d)`` over ``outer`` of each ``inner`` rank's local tensor; ``vescale.dcheckpoint``'s
    layouts read it the same way. ``None`` for every other spec (FSDP2 over a plain tp
    ``Shard``, which torch reads right).

    ``strided_shard`` is torch's private ``_StridedShard`` class (``_compat.strided_shard_type()``).
    """
    placements = spec.placements
    for outer, placement in enumerate(placements):
        if not isinstance(placement, strided_shard):
            continue
        later = [
            inner
            for inner in range(outer + 1, len(placements))
            if isinstance(placements[inner], Shard | strided_shard) and placements[inner].dim == placement.dim
        ]
        if (
            len(later) == 1
            and isinstance(placements[later[0]], strided_shard)
            and spec.mesh.size(later[0]) == placement.split_factor
        ):
            return outer, later[0]
    return None


def inner_local_shape(spec: Any, inner: int) -> list[int]:
    """The shape of one ``inner`` mesh rank's local tensor when only ``inner``'s placement (an
    ``InterleavedShard``: equal parts, each chunked over the mesh dim as ``torch.chunk`` does) is
    applied: what ``nested_strided_dims``'s outer mesh dim cuts."""
    placement = spec.placements[inner]
    shape = list(spec.shape)
    parts = placement.split_factor
    part_length = shape[placement.dim] // parts
    size, index = spec.mesh.size(inner), spec.mesh.get_coordinate()[inner]
    chunk = -(-part_length // size)
    shape[placement.dim] = parts * max(0, min(part_length, (index + 1) * chunk) - index * chunk)
    return shape
