"""Where each rank's piece of a tensor lies in the global tensor: boxes and their overlaps.

A placement on a mesh dim cuts the current local extent of one tensor dim the way
``torch.chunk`` does (``Shard``), or cuts it into ``k`` equal parts and ``torch.chunk``s each
(``InterleavedShard``), so a rank's extent along each tensor dim is a list of global
intervals in local order. The local tensor is their cartesian product: one *box* (global
offsets and sizes, plus where it sits in the local tensor) per combination. Saving and
loading only ever exchange boxes, which is what makes any layout load into any other.

Example::

    layout = TensorLayout.of(dtensor, world_size=4)
    for local_box in layout.local_boxes(rank=1):
        print(local_box.box.offsets, local_box.box.sizes, local_box.local_offsets)
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from vescale.dcheckpoint.errors import CheckpointFormatError
from vescale.dtensor.placements import (
    InterleavedShard,
    PlacementError,
    placement_from_string,
    placement_to_string,
    to_vescale_placements,
)

__all__ = ["Box", "LocalBox", "TensorLayout"]

Interval = tuple[int, int]  # (global start, length)


@dataclass(frozen=True)
class Box:
    """A rectangular region of a global tensor: ``offsets`` and ``sizes`` per tensor dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the region."""
        count = 1
        for size in self.sizes:
            count *= size
        return count

    def intersect(self, other: Box) -> Box | None:
        """The common region of two boxes, or ``None`` when they do not overlap."""
        starts = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        ends = [
            min(a + la, b + lb)
            for a, la, b, lb in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        ]
        if any(start >= end for start, end in zip(starts, ends, strict=True)):
            return None
        return Box(tuple(starts), tuple(end - start for start, end in zip(starts, ends, strict=True)))


@dataclass(frozen=True)
class LocalBox:
    """A box of the global tensor and the offsets at which a rank's local tensor holds it."""

    box: Box
    local_offsets: tuple[int, ...]


# DeviceMesh.mesh rebuilds its rank tensor on every access; a save touches it once per tensor.
_MESH_DESCRIPTIONS: weakref.WeakKeyDictionary[DeviceMesh, tuple[tuple[int, ...], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _mesh_description(mesh: DeviceMesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if mesh not in _MESH_DESCRIPTIONS:
        ranks = mesh.mesh
        _MESH_DESCRIPTIONS[mesh] = (tuple(ranks.shape), tuple(ranks.flatten().tolist()))
    return _MESH_DESCRIPTIONS[mesh]


def _chunk_range(total: int, num_chunks: int, index: int) -> Interval:
    # torch.chunk: chunks of ceil(total / n); trailing indices may get nothing.
    chunk = -(-total // num_chunks)
    start = min(index * chunk, total)
    return start, min(start + chunk, total) - start


def _select(intervals: list[Interval], start: int, length: int) -> list[Interval]:
    """The global intervals covering positions ``[start, start + length)`` of their concatenation."""
    selected, position = [], 0
    for global_start, interval_length in intervals:
        low, high = max(start, position), min(start + length, position + interval_length)
        if low < high:
            selected.append((global_start + low - position, high - low))
        position += interval_length
    return selected


def _merge(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, length in intervals:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        elif length:
            merged.append((start, length))
    return merged


@dataclass(frozen=True)
class TensorLayout:
    """A tensor's global shape and how a mesh of ranks holds it (placements as short strings).

    A plain tensor is a ``Replicate`` on a 1-D mesh of every rank.
    """

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    placements: tuple[str, ...]

    @classmethod
    def of(
        cls, tensor: torch.Tensor, world_size: int, name: str = "tensor", local: torch.Tensor | None = None
    ) -> TensorLayout:
        """The layout of a DTensor or of a plain tensor every rank holds a copy of.

        ``local`` is the DTensor's local tensor when the caller has it already (it saves a
        ``to_local`` call per tensor).
        """
        if not isinstance(tensor, DTensor):
            return cls(tuple(tensor.shape), (world_size,), tuple(range(world_size)), ("R",))
        local_shape = tuple((tensor.to_local() if local is None else local).shape)
        rank = dist.get_rank() if dist.is_initialized() else None
        layout, problem = _dtensor_layout(
            tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape), local_shape, rank
        )
        if problem is not None:
            raise CheckpointFormatError(f"{name!r}{problem}")
        return layout

    def _placements_and_dims(self) -> list[tuple[str, Placement | InterleavedShard, int | None]]:
        """Each mesh dim's placement text, placement and tensor dim (``None`` for Replicate), checked."""
        parsed: list[tuple[str, Placement | InterleavedShard, int | None]] = []
        for text in self.placements:
            try:
                placement = placement_from_string(text)
            except PlacementError as error:
                raise CheckpointFormatError(str(error)) from None
            if isinstance(placement, torch.distributed.tensor.Replicate):
                parsed.append((text, placement, None))
                continue
            if not isinstance(placement, InterleavedShard | torch.distributed.tensor.Shard):
                raise CheckpointFormatError(f"placement {text!r} cannot be saved or loaded")
            if not -len(self.shape) <= placement.dim < len(self.shape):
                raise CheckpointFormatError(f"placement {text!r} names a dim of shape {self.shape}")
            parsed.append((text, placement, placement.dim % len(self.shape)))
        return parsed

    def _application_order(
        self, parsed: Sequence[tuple[str, object, int | None]]
    ) -> tuple[list[int], set[int]]:
        """The mesh dims in the order their placements cut the tensor, and the strided ones.

        FSDP2 shards a tensor-parallel parameter over dp *within* each tp shard: ``(dp, tp)``
        placements ``(_StridedShard(0, sf=tp), Shard(0))``, read here as ``("IS(0,tp)", "S(0)")``.
        Such an InterleavedShard, followed by exactly one later Shard of the same tensor dim on
        a mesh dim of its interleaved size, is a plain Shard applied after that later one. The
        later one may itself be interleaved (GPT-2's fused ``c_attn`` bias ``IS(0,3)`` over tp,
        under ZeRO-3 ``("IS(0,2)", "IS(0,3)")``): dp then cuts each tp rank's concatenated parts.
        """
        strided_after: dict[int, int] = {}
        for mesh_dim, (_, placement, dim) in enumerate(parsed):
            if not isinstance(placement, InterleavedShard):
                continue
            later = [other for other in range(mesh_dim + 1, len(parsed)) if parsed[other][2] == dim]
            if (
                len(later) == 1
                and isinstance(parsed[later[0]][1], torch.distributed.tensor.Shard | InterleavedShard)
                and self.mesh_shape[later[0]] == placement.interleaved_size
            ):
                strided_after[mesh_dim] = later[0]
        order = []
        for mesh_dim in range(len(parsed)):
            if mesh_dim not in strided_after:
                order.append(mesh_dim)
                order.extend(strided for strided, after in strided_after.items() if after == mesh_dim)
        return order, set(strided_after)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - layouts are small immutable values, shared by many tensors
    def _intervals(self, coordinate: tuple[int, ...]) -> tuple[tuple[Interval, ...], ...]:
        intervals: list[list[Interval]] = [[(0, size)] for size in self.shape]
        sharded_by_interleaved: set[int] = set()
        sharded: set[int] = set()
        parsed = self._placements_and_dims()
        order, strided = self._application_order(parsed)
        for mesh_dim in order:
            _, placement, dim = parsed[mesh_dim]
            if dim is None:
                continue
            mesh_size, index = self.mesh_shape[mesh_dim], coordinate[mesh_dim]
            interleaved = isinstance(placement, InterleavedShard) and mesh_dim not in strided
            # a strided placement cuts the local pieces of the one applied before it, whatever they are
            twice = dim in sharded_by_interleaved or (interleaved and dim in sharded)
            if twice and mesh_dim not in strided:
                raise CheckpointFormatError(
                    f"placements {self.placements} shard tensor dim {dim} twice with an "
                    "InterleavedShard among them, which checkpoints do not support; shard another dim"
                )
            sharded.add(dim)
            total = sum(length for _, length in intervals[dim])
            if interleaved:
                sharded_by_interleaved.add(dim)
                # ``interleaved`` above established that the placement is an InterleavedShard.
                parts = cast(InterleavedShard, placement).interleaved_size
                part_length = total // parts
                start, length = _chunk_range(part_length, mesh_size, index)
                intervals[dim] = [
                    piece
                    for part in range(parts)
                    for piece in _select(intervals[dim], part * part_length + start, length)
                ]
            else:
                intervals[dim] = _select(intervals[dim], *_chunk_range(total, mesh_size, index))
        return tuple(tuple(_merge(dim_intervals)) for dim_intervals in intervals)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - see _intervals
    def coordinates(self) -> dict[int, tuple[int, ...]]:
        """Each rank of the mesh and its mesh coordinate."""
        grid = itertools.product(*(range(size) for size in self.mesh_shape))
        return dict(zip(self.mesh_ranks, grid, strict=True))

    @functools.lru_cache(maxsize=16384)  # noqa: B019 - see _intervals; many tensors share a layout
    def local_boxes(self, rank: int) -> tuple[LocalBox, ...]:
        """The boxes rank ``rank`` holds, with their offsets in its local tensor (empty if none)."""
        coordinate = self.coordinates().get(rank)
        if coordinate is None:
            return ()
        per_dim = []
        for dim_intervals in self._intervals(coordinate):
            local_start, placed = 0, []
            for start, length in dim_intervals:
                placed.append((start, length, local_start))
                local_start += length
            per_dim.append(placed)
        return tuple(
            LocalBox(Box(tuple(p[0] for p in combo), tuple(p[1] for p in combo)), tuple(p[2] for p in combo))
            for combo in itertools.product(*per_dim)
        )


@functools.lru_cache(maxsize=4096)
def _dtensor_layout(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    rank: int | None,
) -> tuple[TensorLayout, str | None]:
    """A DTensor's layout and, if it cannot be checkpointed, why (after the tensor's name).

    Cached: a model's tensors share few (mesh, placements, shape) combinations, and working
    one out costs more than reading a small tensor.
    """
    texts = tuple(placement_to_string(p) for p in to_vescale_placements(placements))
    mesh_shape, mesh_ranks = _mesh_description(mesh)
    layout = TensorLayout(shape, mesh_shape, mesh_ranks, texts)
    if any(text.startswith("P") for text in texts):
        return layout, (
            f" has a Partial placement {texts}: its local tensors are not its values. "
            "Redistribute it to Replicate (or Shard) before saving"
        )
    coordinate = layout.coordinates().get(rank) if rank is not None else None
    if coordinate is None:
        return layout, None
    try:
        intervals = layout._intervals(coordinate)
    except CheckpointFormatError as error:
        return layout, f": {error}"
    expected = tuple(sum(length for _, length in dim) for dim in intervals)
    if local_shape != expected:
        return layout, (
            f": the local shard has shape {local_shape} but placements {texts} on mesh "
            f"{layout.mesh_shape} give {expected}; this placement combination is not supported"
        )
    return layout, None
