"""Shard(i) -> Shard(j) through one all-to-all on gloo, counted with CommCounter.

Values are compared bitwise with the single-process tensor cut by ``torch.chunk``: an
all-to-all only moves values. Bytes are computed here from the shapes: a rank sends its
shard less the piece it keeps, and receives the other ranks' pieces of its new shard.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from vescale.dtensor import _compat
from vescale.dtensor.comm import BACKWARD, FORWARD, CommCounter
from vescale.dtensor.mesh import init_mesh
from vescale.dtensor.shard_alltoall import chunk_sizes, install_shard_alltoall
from vescale.dtensor.testing import run_on_ranks

FLOAT32_BYTES = 4

# --- functions that run on the ranks (module level: ranks look them up by name) ---


def _chunk(tensor: torch.Tensor, num_chunks: int, dim: int, index: int) -> torch.Tensor:
    chunks = tensor.chunk(num_chunks, dim)
    return chunks[index] if index < len(chunks) else tensor.narrow(dim, 0, 0)


def alltoall_bytes_on_ranks(shape: tuple[int, ...], old_dim: int, new_dim: int, use_torch_path: bool) -> dict:
    mesh = init_mesh(tp=dist.get_world_size())
    n, rank = mesh.size(), mesh.get_local_rank()
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    source = distribute_tensor(full, mesh, [Shard(old_dim)])
    if use_torch_path:
        _compat.set_shard_to_new_shard_dim(_compat.original_shard_to_new_shard_dim())
    try:
        with CommCounter(mesh) as counter:
            moved = source.redistribute(mesh, [Shard(new_dim)])
    finally:
        install_shard_alltoall()
    # What this rank keeps, sends and receives, from the shapes alone.
    old_rows = [_chunk(full, n, old_dim, r).shape[old_dim] for r in range(n)]
    new_cols = [_chunk(full, n, new_dim, r).shape[new_dim] for r in range(n)]
    other_numel = full.numel() // (shape[old_dim] * shape[new_dim])
    sent = old_rows[rank] * (shape[new_dim] - new_cols[rank]) * other_numel * FLOAT32_BYTES
    received = (shape[old_dim] - old_rows[rank]) * new_cols[rank] * other_numel * FLOAT32_BYTES
    return {
        "bitwise": torch.equal(moved.to_local(), _chunk(full, n, new_dim, rank)),
        "calls": [
            (call.collective, call.mesh_dim, call.bytes_sent, call.bytes_received) for call in counter.calls
        ],
        "expected_alltoall": (sent, received),
        "full_bytes": full.numel() * FLOAT32_BYTES,
    }


def backward_reverse_alltoall_on_ranks() -> dict:
    mesh = init_mesh(tp=dist.get_world_size())
    n, rank = mesh.size(), mesh.get_local_rank()
    full = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    upstream_full = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5) * -2
    source = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    upstream = distribute_tensor(upstream_full, mesh, [Shard(1)])
    with CommCounter(mesh) as counter:
        moved = source.redistribute(mesh, [Shard(1)])
        (moved * upstream).sum().backward()
    # d/d source of sum(source * upstream) is upstream, laid out like source.
    return {
        "forward": torch.equal(moved.to_local(), _chunk(full, n, 1, rank)),
        "grad_placements": tuple(source.grad.placements),
        "grad": torch.equal(source.grad.to_local(), _chunk(upstream_full, n, 0, rank)),
        "all_to_all_phases": [call.phase for call in counter.calls if call.collective == "all_to_all"],
        "collectives": sorted({call.collective for call in counter.calls}),
    }


def propagation_alltoall_on_ranks() -> dict:
    mesh = init_mesh(tp=dist.get_world_size())
    left_full = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    right_full = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10) * 3
    left = distribute_tensor(left_full, mesh, [Shard(0)])
    right = distribute_tensor(right_full, mesh, [Shard(1)])
    with CommCounter(mesh) as counter:
        # Adding Shard(0) to Shard(1): DTensor moves one operand to the other's sharding.
        total = left + right
    return {
        "bitwise": torch.equal(total.full_tensor(), left_full + right_full),
        "collectives": [call.collective for call in counter.calls],
    }


# --- tests (run in the pytest process) ---


@pytest.mark.parametrize(
    ("world_size", "shape", "old_dim", "new_dim"),
    [(2, (4, 6), 0, 1), (4, (8, 12), 0, 1), (4, (6, 5), 0, 1), (4, (3, 2, 7), 2, 0), (4, (5, 3), 1, 0)],
    ids=["2-even", "4-even", "4-uneven", "4-3d-smaller-than-mesh", "4-uneven-back"],
)
def test_shard_to_shard_is_one_alltoall_of_the_exact_pieces(world_size, shape, old_dim, new_dim):
    for result in run_on_ranks(alltoall_bytes_on_ranks, world_size, args=(shape, old_dim, new_dim, False)):
        assert result["bitwise"]
        ((collective, mesh_dim, sent, received),) = result["calls"]
        assert (collective, mesh_dim) == ("all_to_all", "tp")
        assert (sent, received) == result["expected_alltoall"]


def test_torch_cpu_path_all_gathers_n_times_the_bytes_that_the_alltoall_moves():
    shape, n = (8, 12), 4
    torch_path = run_on_ranks(alltoall_bytes_on_ranks, n, args=(shape, 0, 1, True))
    alltoall_path = run_on_ranks(alltoall_bytes_on_ranks, n, args=(shape, 0, 1, False))
    for torch_result, alltoall_result in zip(torch_path, alltoall_path, strict=True):
        assert torch_result["bitwise"] and alltoall_result["bitwise"]
        ((collective, _, _, torch_received),) = torch_result["calls"]
        assert collective == "all_gather"
        # all-gather: (n-1)/n of the whole tensor; all-to-all: (n-1)/n of one shard.
        assert torch_received == (n - 1) / n * torch_result["full_bytes"]
        assert alltoall_result["calls"][0][3] * n == torch_received


def test_backward_of_shard_to_shard_is_the_reverse_alltoall():
    for result in run_on_ranks(backward_reverse_alltoall_on_ranks, world_size=4):
        assert result["forward"] and result["grad"]
        assert result["grad_placements"] == (Shard(0),)
        assert result["all_to_all_phases"] == [FORWARD, BACKWARD]
        assert result["collectives"] == ["all_to_all"]


def test_redistribution_inserted_by_sharding_propagation_uses_the_alltoall():
    for result in run_on_ranks(propagation_alltoall_on_ranks, world_size=2):
        assert result["bitwise"]
        assert result["collectives"] == ["all_to_all"]


def test_install_is_idempotent_and_keeps_torch_original():
    from torch.distributed.tensor.placement_types import Shard as TorchShard

    install_shard_alltoall()
    installed = TorchShard._to_new_shard_dim
    install_shard_alltoall()
    assert TorchShard._to_new_shard_dim is installed
    original = _compat.original_shard_to_new_shard_dim()
    assert original is not installed and original.__module__ == "torch.distributed.tensor.placement_types"


def test_chunk_sizes_follow_torch_chunk():
    for size in range(0, 10):
        for num_chunks in range(1, 6):
            expected = [len(chunk) for chunk in torch.arange(size).chunk(num_chunks)]
            expected += [0] * (num_chunks - len(expected))
            assert chunk_sizes(size, num_chunks) == expected, (size, num_chunks)
