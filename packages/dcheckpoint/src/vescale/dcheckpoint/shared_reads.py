"""Boxes that several ranks need (replicated tensors) are read once and all-gathered.

Without this, every holder of a replicated tensor reads it from disk, so a group of N ranks
reads it N times. Instead the holders of each such box split the reading between them (the
same balanced plan a save uses to split its writing), and the pieces are exchanged in a few
batched all-gathers of raw bytes, so the group reads every needed byte once and the number
of collectives does not grow with the number of tensors.

A box is shared when several ranks hold it: replicated dims of one layout, or the same box
of DTensors on the submeshes of different rank groups (a tensor-parallel parameter in each
data-parallel group). Every rank must run the same exchange: the ranks agree on the union of
the layouts they load each tensor in (one digest exchange when their states are the same),
so that ranks without a tensor (another pipeline stage) still take part.

Example::

    shared = SharedReads.plan(layouts, dtypes, rank)
    own_boxes = [b for b in layout.local_boxes(rank) if not shared.is_shared(name, b.box)]
    shared.exchange(reader, index, locals_by_name, layouts)   # fills the shared boxes
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vescale.dcheckpoint._collectives import rank_and_world_size
from vescale.dcheckpoint.index import CheckpointIndex
from vescale.dcheckpoint.layout import Box, TensorLayout
from vescale.dcheckpoint.rank_sets import agree_layouts, describe_layouts, held_boxes
from vescale.dcheckpoint.reader import ShardReader
from vescale.dcheckpoint.safetensors_format import DTYPE_BY_NAME
from vescale.dcheckpoint.writer import PlannedChunk, assign_boxes
from vescale.dtensor.mesh import device_type_for_backend

__all__ = ["ROUND_BYTES", "SharedReads"]

# Bytes one rank contributes to one all-gather at most (a larger piece goes alone): bounds the
# N x ROUND_BYTES receive buffer.
ROUND_BYTES = 256 << 20
_ALIGNMENT = 16


@dataclass(frozen=True)
class SharedReads:
    """The pieces of shared boxes, each read by one of its holders, and which boxes are shared."""

    rank: int
    pieces: tuple[PlannedChunk, ...]
    shared_boxes: frozenset[tuple[str, Box]]

    @classmethod
    def plan(
        cls,
        layouts: Mapping[str, TensorLayout],
        dtypes: Mapping[str, torch.dtype],
        rank: int,
        plain: frozenset[str] = frozenset(),
    ) -> SharedReads:
        """Agree with the other ranks on the shared tensors and plan who reads which piece.

        ``plain`` names the tensors that are not DTensors: their layout says every rank holds
        them, which is only true when every rank loads them.

        Example::

            shared = SharedReads.plan({"w": layout}, {"w": torch.float32}, rank)
            shared.is_shared("w", layout.local_boxes(rank)[0].box)   # True for a Replicate layout
        """
        if rank_and_world_size()[1] == 1:
            return cls(rank, (), frozenset())
        description = describe_layouts(layouts, dtypes, plain)
        agreed = agree_layouts(description)
        if agreed is None:
            every_rank = list(range(rank_and_world_size()[1]))
            agreed = {name: [(described, every_rank)] for name, described in description.items()}
        boxes: list[tuple[str, Box, tuple[int, ...]]] = []
        for name, held in agreed.items():
            holders: dict[Box, set[int]] = {}
            for described, describers in held:
                for box, ranks in held_boxes(described, describers):
                    holders.setdefault(box, set()).update(ranks)
            boxes.extend(
                (name, box, tuple(sorted(ranks))) for box, ranks in holders.items() if len(ranks) > 1
            )
        agreed_dtypes = {name: DTYPE_BY_NAME[held[0][0][1]] for name, held in agreed.items()}
        pieces = tuple(assign_boxes(boxes, agreed_dtypes))
        shared = frozenset((name, box) for name, box, _ in boxes)
        return cls(rank, pieces, shared)

    def is_shared(self, name: str, box: Box) -> bool:
        """Whether ``box`` of tensor ``name`` is filled by :meth:`exchange` rather than read."""
        return (name, box) in self.shared_boxes

    def _rounds(self) -> list[list[PlannedChunk]]:
        rounds: list[list[PlannedChunk]] = [[]]
        totals: dict[int, int] = {}
        for piece in self.pieces:
            if totals.get(piece.writer_rank, 0) and totals[piece.writer_rank] + piece.nbytes > ROUND_BYTES:
                rounds.append([])
                totals = {}
            rounds[-1].append(piece)
            totals[piece.writer_rank] = totals.get(piece.writer_rank, 0) + piece.nbytes
        return [round_pieces for round_pieces in rounds if round_pieces]

    def exchange(
        self,
        reader: ShardReader,
        index: CheckpointIndex,
        locals_by_name: Mapping[str, torch.Tensor],
        layouts: Mapping[str, TensorLayout],
    ) -> None:
        """Read this rank's pieces, all-gather every round, and copy in the pieces of the boxes it holds.

        Example::

            shared.exchange(reader, index, {"w": param.to_local()}, {"w": layout})
        """
        world_size = rank_and_world_size()[1]
        device = device_type_for_backend(dist.get_backend()) if world_size > 1 else "cpu"
        for round_pieces in self._rounds():
            starts, totals = [], [0] * world_size
            for piece in round_pieces:
                starts.append(totals[piece.writer_rank])
                # Aligned, so that every dtype can view its slot of the byte buffer.
                totals[piece.writer_rank] += -(-piece.nbytes // _ALIGNMENT) * _ALIGNMENT
            mine = torch.empty(max(totals), dtype=torch.uint8)
            for piece, start in zip(round_pieces, starts, strict=True):
                if piece.writer_rank == self.rank:
                    record = index.tensors[piece.name]
                    destination = mine[start : start + piece.nbytes].view(record.dtype).view(piece.box.sizes)
                    reader.read_box(record, piece.box, destination)
            gathered = [torch.empty_like(mine, device=device) for _ in range(world_size)]
            dist.all_gather(gathered, mine.to(device))
            gathered = [buffer.cpu() for buffer in gathered]
            for piece, start in zip(round_pieces, starts, strict=True):
                if self.rank not in piece.holders or piece.name not in locals_by_name:
                    continue
                values = gathered[piece.writer_rank][start : start + piece.nbytes]
                self._deliver(piece, values, locals_by_name[piece.name], layouts[piece.name], reader)

    def _deliver(
        self,
        piece: PlannedChunk,
        values: torch.Tensor,
        local: torch.Tensor,
        layout: TensorLayout,
        reader: ShardReader,
    ) -> None:
        for local_box in layout.local_boxes(self.rank):
            if local_box.box.intersect(piece.box) == piece.box:
                starts = [
                    lo + o - b
                    for lo, o, b in zip(
                        local_box.local_offsets, piece.box.offsets, local_box.box.offsets, strict=True
                    )
                ]
                target = local[tuple(slice(s, s + n) for s, n in zip(starts, piece.box.sizes, strict=True))]
                target.copy_(values.view(local.dtype).view(piece.box.sizes))
                reader.stats.bytes_needed += piece.nbytes
                if piece.writer_rank != self.rank:
                    reader.stats.bytes_received += piece.nbytes
                return
        raise AssertionError(f"rank {self.rank} holds no box containing {piece.box} of {piece.name!r}")
