"""Ranks that hold different tensors: agree on the union of their layouts, then on who holds what.

Each rank describes the tensors it saves or loads (global shape, dtype, mesh, placements).
Usually every rank describes the same ones, and one digest exchange confirms it. Pipeline
stages differ: a pp rank holds only its stages' parameters, as plain tensors or as DTensors
on its own tensor-parallel sub-mesh, and the dp replicas of a stage hold the same DTensor on
other sub-meshes. Then the ranks exchange their descriptions once, and every rank builds the
same union: per tensor name, every layout some rank holds it in (a plain tensor is held by
the ranks that have it, not by every rank). One global shape and dtype per name is required.

From the union, the distinct boxes of each tensor and the ranks holding each box: the boxes
of one layout (the one with the fewest), each held by every rank whose own box contains it,
so a tensor that several groups hold is written once and read once, by any of them.

Example::

    union = agree_layouts(describe_layouts(layouts, dtypes, plain))
    plan = plan_union_chunks(union) if union is not None else plan_chunks(layouts, dtypes)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from vescale.dcheckpoint._collectives import gather_if_different
from vescale.dcheckpoint.errors import CheckpointMismatchError
from vescale.dcheckpoint.layout import Box, TensorLayout
from vescale.dcheckpoint.safetensors_format import DTYPE_BY_NAME, dtype_name
from vescale.dcheckpoint.writer import PlannedChunk, assign_boxes, box_holders

__all__ = [
    "LayoutUnion",
    "agree_layouts",
    "describe_layouts",
    "held_boxes",
    "layout_of",
    "plan_union_chunks",
    "union_box_holders",
]

# A tensor's description: [shape, dtype name, mesh shape, mesh ranks, placements, is plain].
Description = list[Any]
# Per tensor name, every distinct description some rank holds it in, with the ranks that gave it.
LayoutUnion = dict[str, list[tuple[Description, list[int]]]]


def describe_layouts(
    layouts: Mapping[str, TensorLayout], dtypes: Mapping[str, torch.dtype], plain: frozenset[str]
) -> dict[str, Description]:
    """This rank's description of each of its tensors; ``plain`` names those that are not DTensors.

    Example::

        describe_layouts({"w": layout}, {"w": torch.float32}, frozenset())["w"][:2]   # [[8, 4], "F32"]
    """
    return {
        name: [
            list(lay.shape),
            dtype_name(dtypes[name]),
            list(lay.mesh_shape),
            list(lay.mesh_ranks),
            list(lay.placements),
            name in plain,
        ]
        for name, lay in layouts.items()
    }


def agree_layouts(
    description: dict[str, Description], group: dist.ProcessGroup | None = None
) -> LayoutUnion | None:
    """``None`` when every rank described the same tensors, else the union of every rank's layouts.

    Raises :class:`CheckpointMismatchError` naming the tensor and two ranks when they disagree
    on its global shape or dtype.

    Example::

        union = agree_layouts(describe_layouts(layouts, dtypes, plain))
        union is None or sorted(union)   # every name any rank holds
    """
    encoded = json.dumps(description, sort_keys=True).encode()
    gathered = gather_if_different(encoded, group)
    if gathered is None:
        return None
    union: LayoutUnion = {}
    for rank, raw in enumerate(gathered):
        for name, described in json.loads(raw).items():
            known = union.setdefault(name, [])
            if known and known[0][0][:2] != described[:2]:
                first = known[0][0]
                raise CheckpointMismatchError(
                    f"{name!r} has shape {tuple(first[0])} and dtype {first[1]} on rank {known[0][1][0]} but "
                    f"shape {tuple(described[0])} and dtype {described[1]} on rank {rank}; every rank that "
                    "holds a tensor must hold it with the same global shape and dtype"
                )
            same = next((ranks for other, ranks in known if other == described), None)
            if same is None:
                known.append((described, [rank]))
            else:
                same.append(rank)
    return union


def layout_of(described: Description) -> TensorLayout:
    """The :class:`TensorLayout` a description stands for."""
    shape, _, mesh_shape, mesh_ranks, placements, _ = described
    return TensorLayout(tuple(shape), tuple(mesh_shape), tuple(mesh_ranks), tuple(placements))


def _contains(outer: Box, inner: Box) -> bool:
    return outer.intersect(inner) == inner


def held_boxes(described: Description, describers: list[int]) -> list[tuple[Box, tuple[int, ...]]]:
    """The boxes of a layout, each with the ranks that hold it and described the tensor so.

    Example::

        held_boxes(stage0_weight_on_pp_x_tp, [0, 1])   # rows 0-3 by (0,), rows 4-7 by (1,)
    """
    present = set(describers)
    boxes = []
    for box, ranks in box_holders(layout_of(described)):
        holding = tuple(rank for rank in ranks if rank in present)
        if holding:
            boxes.append((box, holding))
    return boxes


def union_box_holders(held: list[tuple[Description, list[int]]]) -> list[tuple[Box, tuple[int, ...]]]:
    """The distinct boxes of a tensor held in several layouts, each with every rank holding it whole.

    Example::

        union_box_holders([(tp_shard_on_ranks_0_1, [0, 1]), (tp_shard_on_ranks_2_3, [2, 3])])
        # [(rows 0-3, (0, 2)), (rows 4-7, (1, 3))]
    """
    per_layout = [held_boxes(described, describers) for described, describers in held]
    if all({box for box, _ in boxes} == {box for box, _ in per_layout[0]} for boxes in per_layout):
        merged: dict[Box, set[int]] = {}
        for boxes in per_layout:
            for box, ranks in boxes:
                merged.setdefault(box, set()).update(ranks)
        return [(box, tuple(sorted(ranks))) for box, ranks in merged.items()]
    # Layouts that cut the tensor differently: the coarsest one's boxes, each held by every rank
    # whose own box covers it whole (so the writer can cut it out of its local tensor).
    tiling = min(per_layout, key=len)
    covering = []
    for box, _ in tiling:
        covering_ranks: set[int] = set()
        for boxes in per_layout:
            for held_box, holders in boxes:
                if _contains(held_box, box):
                    covering_ranks.update(holders)
        covering.append((box, tuple(sorted(covering_ranks))))
    return covering


def plan_union_chunks(union: LayoutUnion) -> list[PlannedChunk]:
    """Every distinct box of every tensor of ``union``, each assigned to one holder, balanced.

    Example::

        plan = plan_union_chunks(agree_layouts(describe_layouts(layouts, dtypes, plain)))
        mine = [chunk for chunk in plan if chunk.writer_rank == rank]
    """
    boxes = [(name, box, holders) for name, held in union.items() for box, holders in union_box_holders(held)]
    dtypes = {name: DTYPE_BY_NAME[held[0][0][1]] for name, held in union.items()}
    return assign_boxes(boxes, dtypes)
