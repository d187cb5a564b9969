"""Uneven shards (sizes not divisible by the mesh) on real gloo ranks, with torch.chunk semantics.

Each rank's local shard is compared bitwise with the single-process tensor cut by
``torch.chunk`` (mesh dim 0 first, then mesh dim 1; a rank past the last chunk holds an
empty slice), and each op's ``full_tensor()`` bitwise with the op on the full tensor.
Values are small integers stored in float32, so sums and matmuls over them are exact
whatever order a shard adds them in: bitwise is the right tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import vescale.dtensor.shard_alltoall  # noqa: F401  (Shard(i) -> Shard(j) through all-to-all)
from vescale.dtensor.comm import CommCounter
from vescale.dtensor.mesh import init_mesh
from vescale.dtensor.ops.views import UNEVEN_FLATTEN_ERROR
from vescale.dtensor.placements import placement_from_string, placement_to_string
from vescale.dtensor.testing import run_on_ranks

# Dims of 5, 3 and 7: uneven over 2 and 4 ranks, and 3 is smaller than a 4-rank mesh.
FULL_SHAPE = (5, 3, 7)
MESH_SHAPES = [(2,), (4,), (2, 2)]
MESH_IDS = ["2", "4", "2x2"]


def _integer_tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


# --- functions that run on the ranks (module level: ranks look them up by name) ---


def _mesh(mesh_shape: tuple[int, ...]):
    return (
        init_mesh(tp=mesh_shape[0]) if len(mesh_shape) == 1 else init_mesh(dp=mesh_shape[0], tp=mesh_shape[1])
    )


def _expected_local(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """The single-process tensor cut with torch.chunk, mesh dim by mesh dim."""
    local = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            rank, chunks = mesh.get_local_rank(mesh_dim), local.chunk(mesh.size(mesh_dim), placement.dim)
            local = chunks[rank] if rank < len(chunks) else local.narrow(placement.dim, 0, 0)
    return local


def redistributions_on_ranks(mesh_shape: tuple[int, ...], moves: list[tuple[list[str], list[str]]]) -> dict:
    mesh = _mesh(mesh_shape)
    full = _integer_tensor(FULL_SHAPE, seed=0)
    results = {}
    for source_texts, target_texts in moves:
        source = [placement_from_string(text) for text in source_texts]
        target = [placement_from_string(text) for text in target_texts]
        if any(isinstance(placement, Partial) for placement in source):
            # tp rank r holds (r + 1) * its source shard: the pending sum is n(n+1)/2 * full, exact.
            tp_size = mesh.size(mesh.ndim - 1)
            reduced_full = full * (tp_size * (tp_size + 1) // 2)
            replicated_source = [Replicate() if isinstance(p, Partial) else p for p in source]
            local = _expected_local(full, mesh, replicated_source) * (mesh.get_local_rank(mesh.ndim - 1) + 1)
            dtensor = DTensor.from_local(local, mesh, source, shape=full.shape, stride=full.stride())
        else:
            reduced_full = full
            dtensor = distribute_tensor(full, mesh, source)
            assert torch.equal(dtensor.to_local(), _expected_local(full, mesh, source))
        with CommCounter(mesh) as counter:
            moved = dtensor.redistribute(mesh, target)
        key = f"{','.join(source_texts)}->{','.join(target_texts)}"
        results[key] = (
            torch.equal(moved.to_local(), _expected_local(reduced_full, mesh, target)),
            torch.equal(moved.full_tensor(), reduced_full),
            sorted({call.collective for call in counter.calls}),
        )
    return results


def ops_on_ranks(mesh_shape: tuple[int, ...], placement_texts: list[str]) -> dict:
    mesh = _mesh(mesh_shape)
    placements = [placement_from_string(text) for text in placement_texts]
    full = _integer_tensor(FULL_SHAPE, seed=1)
    other_full = _integer_tensor(FULL_SHAPE, seed=2)
    weight_full = _integer_tensor((FULL_SHAPE[-1], 4), seed=3)
    x = distribute_tensor(full, mesh, placements)
    other = distribute_tensor(other_full, mesh, placements)
    weight = distribute_tensor(weight_full, mesh, [Replicate()] * mesh.ndim)
    tail = FULL_SHAPE[1:]
    cases = {
        "elementwise": (lambda t, o, w: (t * 2 - o).relu() + o, True),
        "softmax_last": (lambda t, o, w: t.softmax(-1), False),
        "sum": (lambda t, o, w: t.sum(), True),
        "sum_dim0": (lambda t, o, w: t.sum(0), True),
        "sum_dim1": (lambda t, o, w: t.sum(1), True),
        "matmul_2d": (lambda t, o, w: t[:, 0] @ w, True),
        "matmul_last_dims": (lambda t, o, w: t.transpose(0, 1) @ w, True),
        "transpose": (lambda t, o, w: t.transpose(0, 2), True),
        "permute": (lambda t, o, w: t.permute(1, 2, 0), True),
        "unsqueeze": (lambda t, o, w: t.unsqueeze(1), True),
        "view_keep_sharded_dims": (lambda t, o, w: t.view(FULL_SHAPE[0], *tail).unsqueeze(-1), True),
    }
    if placement_texts[-1] == "S(1)":
        # A sharded dim merged into the dims before it: DTensor keeps it as _StridedShard.
        cases["view_merge_into_sharded_dim"] = (lambda t, o, w: t.view(-1, FULL_SHAPE[2]), True)
    results = {}
    with torch.no_grad():
        for name, (function, exact) in cases.items():
            result = function(x, other, weight)
            reference = function(full, other_full, weight_full)
            same = (
                torch.equal(result.full_tensor(), reference)
                if exact
                else torch.allclose(result.full_tensor(), reference, rtol=0, atol=1e-6)
            )
            results[name] = (same, [placement_to_string(p) for p in result.placements])
    return results


def flatten_uneven_leading_shard_on_ranks() -> str:
    mesh = _mesh((4,))
    x = distribute_tensor(_integer_tensor(FULL_SHAPE, seed=4), mesh, [Shard(0)])
    try:
        x.view(-1, FULL_SHAPE[2])
    except RuntimeError as error:
        return str(error)
    return "no error"


# --- tests (run in the pytest process) ---


def _world_size(mesh_shape: tuple[int, ...]) -> int:
    return int(torch.tensor(mesh_shape).prod())


def _on_tp(mesh_shape: tuple[int, ...], dp_text: str, tp_texts: list[str]) -> list[str]:
    return tp_texts if len(mesh_shape) == 1 else [dp_text, *tp_texts]


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=MESH_IDS)
def test_uneven_redistributions_match_torch_chunk_of_the_single_process_tensor(mesh_shape):
    # On 2x2, dp also shards dim 2 (7 -> 4|3) or dim 0 (5 -> 3|2): tp then cuts shards whose
    # sizes differ by rank, and moves shards of a dim that dp already cut.
    moves = []
    for dp_text in ["R", "S(2)", "S(0)"] if len(mesh_shape) == 2 else ["R"]:
        for source, target in [
            ("S(0)", "R"),
            ("R", "S(0)"),
            ("R", "S(1)"),
            ("S(0)", "S(1)"),
            ("S(1)", "S(0)"),
            ("S(2)", "S(1)"),
            ("P", "S(0)"),
            ("P", "S(1)"),
            ("P", "R"),
        ]:
            moves.append((_on_tp(mesh_shape, dp_text, [source]), _on_tp(mesh_shape, dp_text, [target])))
    expected_collective = {
        "S->R": ["all_gather"],
        "R->S": [],
        "S->S": ["all_to_all"],
        "P->S": ["reduce_scatter"],
        "P->R": ["all_reduce"],
    }
    for results in run_on_ranks(redistributions_on_ranks, _world_size(mesh_shape), args=(mesh_shape, moves)):
        assert len(results) == len(moves)
        for key, (local_matches, full_matches, collectives) in results.items():
            assert local_matches and full_matches, key
            tp_move = key.split("->")
            kind = f"{tp_move[0].split(',')[-1][0]}->{tp_move[1].split(',')[-1][0]}"
            assert collectives == expected_collective[kind], key


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("tp_text", ["S(0)", "S(1)"])
def test_common_ops_on_uneven_shards_match_the_single_process_result(mesh_shape, tp_text):
    placements = _on_tp(mesh_shape, "S(2)", [tp_text])
    for results in run_on_ranks(ops_on_ranks, _world_size(mesh_shape), args=(mesh_shape, placements)):
        for name, (same, placements_out) in results.items():
            assert same, (name, placements_out)


def test_view_flattening_an_uneven_shard_into_the_dims_after_it_fails_loudly():
    # 5 rows over 4 ranks hold 2|2|1|0 rows; flattened with 3 columns that is 6|6|3|0 elements,
    # which no Shard of 15 elements describes (torch.chunk gives 4|4|4|3), and a view cannot
    # move data. PyTorch raises (rather than computing wrong values); redistribute first.
    # (torch 2.11 and 2.13 word the error differently; views.UNEVEN_FLATTEN_ERROR is this torch's.)
    for message in run_on_ranks(flatten_uneven_leading_shard_on_ranks, world_size=4):
        assert UNEVEN_FLATTEN_ERROR in message
