"""CommCounter on real gloo ranks: type, mesh dim, bytes, phase, timestamps of each collective.

Every expected byte count is computed here from the tensor shapes with the ring convention
(n ranks, S the collective's size in bytes): all-gather (n-1)/n·S each way (S the gathered
output), reduce-scatter (n-1)/n·S (S the unreduced input), all-reduce 2(n-1)/n·S,
all-to-all the input less the rank's own piece sent and the output less its own piece
received. Values are compared bitwise with the single-process tensor: redistributions
only move or add values, and sums of two or four small integers are exact in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import vescale.dtensor.shard_alltoall  # noqa: F401  (Shard(i) -> Shard(j) through all-to-all)
from vescale.dtensor.comm import BACKWARD, FORWARD, CommAccountingError, CommCounter, bytes_moved
from vescale.dtensor.mesh import init_mesh
from vescale.dtensor.testing import run_on_ranks

FLOAT32_BYTES = 4

# --- functions that run on the ranks (module level: ranks look them up by name) ---


def _mesh(mesh_shape: tuple[int, ...]):
    return (
        init_mesh(tp=mesh_shape[0]) if len(mesh_shape) == 1 else init_mesh(dp=mesh_shape[0], tp=mesh_shape[1])
    )


def _placements(mesh, inner: list) -> list:
    """``inner`` on the mesh's last dim ("tp"), Replicate on the others."""
    return [Replicate()] * (mesh.ndim - 1) + inner


def _only_call(counter: CommCounter):
    assert len(counter.calls) == 1, counter.table()
    return counter.calls[0]


def redistributions_on_ranks(mesh_shape: tuple[int, ...]) -> dict:
    mesh = _mesh(mesh_shape)
    n = mesh.size(mesh.ndim - 1)
    tp_rank = mesh.get_local_rank("tp")
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    numel_bytes = full.numel() * FLOAT32_BYTES
    ring_one_way = (n - 1) / n * numel_bytes
    moves = {}

    sharded = distribute_tensor(full, mesh, _placements(mesh, [Shard(0)]))
    with CommCounter(mesh) as counter:
        replicated = sharded.redistribute(mesh, _placements(mesh, [Replicate()]))
    assert torch.equal(replicated.to_local(), full)
    moves["shard_to_replicate"] = (_only_call(counter), "all_gather", "tp", ring_one_way, ring_one_way)

    # Each rank holds (rank + 1) * full: the pending sum is (n(n+1)/2) * full, exact in float32.
    partial_local = full * (dist.get_rank() + 1)
    expected_sum = sum(full * (rank + 1) for rank in dist.get_process_group_ranks(mesh.get_group("tp")))
    partial = DTensor.from_local(partial_local, mesh, _placements(mesh, [Partial()]))
    with CommCounter(mesh) as counter:
        reduced = partial.redistribute(mesh, _placements(mesh, [Replicate()]))
    assert torch.equal(reduced.to_local(), expected_sum)
    moves["partial_to_replicate"] = (
        _only_call(counter),
        "all_reduce",
        "tp",
        2 * ring_one_way,
        2 * ring_one_way,
    )

    partial = DTensor.from_local(partial_local, mesh, _placements(mesh, [Partial()]))
    with CommCounter(mesh) as counter:
        scattered = partial.redistribute(mesh, _placements(mesh, [Shard(0)]))
    assert torch.equal(scattered.to_local(), expected_sum.chunk(n, 0)[tp_rank])
    moves["partial_to_shard"] = (_only_call(counter), "reduce_scatter", "tp", ring_one_way, ring_one_way)

    # All-to-all: each rank keeps its own (8/n, 12/n) piece and exchanges the other n-1 pieces.
    piece_bytes = (8 // n) * (12 // n) * FLOAT32_BYTES
    with CommCounter(mesh) as counter:
        transposed = sharded.redistribute(mesh, _placements(mesh, [Shard(1)]))
    assert torch.equal(transposed.to_local(), full.chunk(n, 1)[tp_rank])
    moves["shard0_to_shard1"] = (
        _only_call(counter),
        "all_to_all",
        "tp",
        (n - 1) * piece_bytes,
        (n - 1) * piece_bytes,
    )

    if mesh.ndim == 2:
        # Gathering over dp the (8, 12/tp) column block that tp leaves each rank.
        dp_size = mesh.size(0)
        block_bytes = numel_bytes // n
        both = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        with CommCounter(mesh) as counter:
            columns = both.redistribute(mesh, [Replicate(), Shard(1)])
        assert torch.equal(columns.to_local(), full.chunk(n, 1)[tp_rank])
        dp_one_way = (dp_size - 1) / dp_size * block_bytes
        moves["dp_shard_to_replicate"] = (_only_call(counter), "all_gather", "dp", dp_one_way, dp_one_way)

    return {
        name: (call.collective, call.mesh_dim, call.bytes_sent, call.bytes_received, call.phase, expected)
        for name, (call, *expected) in moves.items()
    }


# torch 2.13 names the single-tensor collectives *_single and deprecates torch 2.11's names for them.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def eager_calls_on_ranks(mesh_shape: tuple[int, ...]) -> list:
    mesh = _mesh(mesh_shape)
    tp_group = mesh.get_group("tp")
    n = tp_group.size()
    world = dist.get_world_size()
    local = torch.ones(12)
    local_bytes = local.numel() * FLOAT32_BYTES
    with CommCounter(mesh) as counter:
        dist.all_reduce(local.clone())  # default group
        dist.all_reduce(local.clone(), group=tp_group)
        _all_gather_single(torch.empty(12 * n), local, group=tp_group)
        _reduce_scatter_single(torch.empty(12 // n), local.clone(), group=tp_group)
        dist.all_to_all_single(torch.empty(12), local, group=tp_group)
        dist.broadcast(local.clone(), src=dist.get_process_group_ranks(tp_group)[0], group=tp_group)
    tp_is_world = n == world
    world_dim = "tp" if tp_is_world else "world"
    root = tp_group.rank() == 0
    expected = [
        (
            "all_reduce",
            world_dim,
            2 * (world - 1) / world * local_bytes,
            2 * (world - 1) / world * local_bytes,
        ),
        ("all_reduce", "tp", 2 * (n - 1) / n * local_bytes, 2 * (n - 1) / n * local_bytes),
        ("all_gather", "tp", (n - 1) * local_bytes, (n - 1) * local_bytes),
        ("reduce_scatter", "tp", (n - 1) / n * local_bytes, (n - 1) / n * local_bytes),
        ("all_to_all", "tp", (n - 1) / n * local_bytes, (n - 1) / n * local_bytes),
        ("broadcast", "tp", local_bytes if root else 0, 0 if root else local_bytes),
    ]
    seen = [(c.collective, c.mesh_dim, c.bytes_sent, c.bytes_received) for c in counter.calls]
    return [seen, expected]


def rooted_and_point_to_point_calls_on_ranks() -> list:
    mesh = _mesh((2,))
    rank = dist.get_rank()
    local = torch.ones(5)
    local_bytes = local.numel() * FLOAT32_BYTES
    with CommCounter(mesh) as counter:
        dist.all_gather([torch.empty(5), torch.empty(5)], local)
        dist.reduce(local.clone(), dst=0)
        dist.gather(local, [torch.empty(5), torch.empty(5)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty(5), [local, local] if rank == 0 else None, src=0)
        if rank == 0:
            dist.send(local, dst=1)
        else:
            dist.recv(torch.empty(5), src=0)
        dist.barrier()
    root = rank == 0
    expected = [
        ("all_gather", local_bytes, local_bytes),  # (n-1)/n of the 2-tensor output
        ("reduce", 0, local_bytes) if root else ("reduce", local_bytes, 0),
        ("gather", 0, local_bytes) if root else ("gather", local_bytes, 0),
        ("scatter", local_bytes, 0) if root else ("scatter", 0, local_bytes),
        ("send", local_bytes, 0) if root else ("recv", 0, local_bytes),
        ("barrier", 0, 0),
    ]
    seen = [(call.collective, call.bytes_sent, call.bytes_received) for call in counter.calls]
    return [seen, expected, {call.mesh_dim for call in counter.calls}]


def backward_phase_and_timestamps_on_ranks() -> list:
    mesh = _mesh((dist.get_world_size(),))
    weight = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Replicate()]).requires_grad_()
    to_reduce = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    with CommCounter(mesh) as counter:
        # Replicate -> Shard is local in forward; its backward all-gathers the gradient.
        sharded = weight.redistribute(mesh, [Shard(0)])
        gathered = to_reduce.redistribute(mesh, [Replicate()])
        loss = (sharded.to_local() * 3).sum() + gathered.to_local().sum()
        loss.backward()
        dist.barrier()
    assert torch.equal(weight.grad.full_tensor(), torch.full((4, 4), 3.0))
    return [
        (call.collective, call.phase, call.start_ns, call.issued_ns, call.completed_ns)
        for call in counter.calls
    ]


def nested_and_reset_on_ranks() -> dict:
    mesh = _mesh((dist.get_world_size(),))
    value = torch.ones(4)
    with CommCounter(mesh) as outer:
        dist.all_reduce(value)
        with CommCounter(mesh) as inner:
            dist.all_reduce(value)
            dist.all_reduce(value)
        dist.broadcast(value, src=0)
        counts = {
            "outer": outer.count(),
            "inner": inner.count(),
            "inner_all_reduce": inner.count("all_reduce"),
        }
        outer.reset()
        dist.all_reduce(value)
        counts["outer_after_reset"] = outer.count()
    counts["summary_keys"] = list(outer.summary())
    counts["table_lines"] = len(outer.table().splitlines())
    try:
        outer.count("allreduce")
    except CommAccountingError as error:
        counts["error"] = str(error)
    return counts


def nccl_path_alltoall_op_on_ranks() -> tuple:
    # DTensor's all-to-all op (its NCCL path) also runs on gloo; the counter must see it whole.
    mesh = _mesh((dist.get_world_size(),))
    local = torch.arange(8.0).reshape(4, 2)
    with CommCounter(mesh) as counter:
        torch.ops._dtensor.shard_dim_alltoall(local, 0, 1, mesh.get_group("tp").group_name)
    call = _only_call(counter)
    return call.collective, call.mesh_dim, call.bytes_sent, call.bytes_received, call.completed_ns is not None


# --- tests (run in the pytest process) ---


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_each_redistribution_counts_its_collective_type_mesh_dim_and_ring_bytes(mesh_shape):
    for moves in run_on_ranks(
        redistributions_on_ranks, world_size=int(torch.tensor(mesh_shape).prod()), args=(mesh_shape,)
    ):
        assert len(moves) == (5 if len(mesh_shape) == 2 else 4)
        for name, (collective, mesh_dim, sent, received, phase, expected) in moves.items():
            assert (collective, mesh_dim, phase) == (expected[0], expected[1], FORWARD), name
            assert (sent, received) == pytest.approx(tuple(expected[2:])), name


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_eager_torch_distributed_calls_are_counted_on_their_group(mesh_shape):
    for seen, expected in run_on_ranks(
        eager_calls_on_ranks, world_size=int(torch.tensor(mesh_shape).prod()), args=(mesh_shape,)
    ):
        assert [call[:2] for call in seen] == [call[:2] for call in expected]
        for seen_call, expected_call in zip(seen, expected, strict=True):
            assert seen_call[2:] == pytest.approx(expected_call[2:]), seen_call


def test_rooted_and_point_to_point_calls_follow_the_byte_convention():
    for seen, expected, mesh_dims in run_on_ranks(rooted_and_point_to_point_calls_on_ranks, world_size=2):
        assert seen == expected
        assert mesh_dims == {"tp"}  # a 1-D mesh over every rank: its group is the world


def test_backward_collectives_are_attributed_to_backward_with_monotonic_timestamps():
    for calls in run_on_ranks(backward_phase_and_timestamps_on_ranks, world_size=2):
        assert [call[:2] for call in calls] == [
            ("all_gather", FORWARD),
            ("all_gather", BACKWARD),
            ("barrier", FORWARD),
        ]
        for _, _, start_ns, issued_ns, completed_ns in calls:
            assert completed_ns is not None and start_ns <= issued_ns <= completed_ns
        starts = [call[2] for call in calls]
        assert starts == sorted(starts)


def test_counters_nest_and_reset():
    for counts in run_on_ranks(nested_and_reset_on_ranks, world_size=2):
        assert counts["outer"] == 4 and counts["inner"] == 2 and counts["inner_all_reduce"] == 2
        assert counts["outer_after_reset"] == 1
        assert counts["summary_keys"] == [("all_reduce", "tp")]
        assert counts["table_lines"] == 4  # header, rule, one row, total
        assert "unknown collective 'allreduce'" in counts["error"] and "all_reduce" in counts["error"]


def test_bytes_moved_follows_the_ring_convention():
    # 4096 bytes over 4 ranks: ring all-reduce moves 2·3/4·S each way, all-gather 3/4·S.
    assert bytes_moved("all_reduce", 4096, 4) == (6144.0, 6144.0)
    assert bytes_moved("all_gather", 4096, 4) == (3072.0, 3072.0)
    assert bytes_moved("reduce_scatter", 4096, 4) == (3072.0, 3072.0)
    assert bytes_moved("broadcast", 4096, 4, is_root=True) == (4096.0, 0.0)
    assert bytes_moved("all_reduce", 4096, 1) == (0.0, 0.0)
    with pytest.raises(CommAccountingError, match="unknown collective 'allgather'"):
        bytes_moved("allgather", 4096, 4)


def test_dtensor_alltoall_op_of_the_nccl_path_is_counted():
    # 2 ranks, a (4, 2) float32 input: each rank keeps half and sends the other half (16 bytes).
    for result in run_on_ranks(nccl_path_alltoall_op_on_ranks, world_size=2):
        assert result == ("all_to_all", "tp", 16.0, 16.0, True)
