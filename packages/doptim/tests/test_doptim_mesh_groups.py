"""Groups over several mesh dims belong to the mesh object and the process group world they were made in."""

from __future__ import annotations

import os

import torch.distributed as dist

from vescale.doptim.mesh_groups import mesh_dims_group
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool

# A mesh that outlives its world, as one caught in a reference cycle does until the cyclic
# collector runs (the test ranks are pooled: the next test's world starts in the same process).
_SURVIVORS: list = []


def _make_and_keep_a_dp_ep_mesh() -> int:
    mesh = init_mesh(dp=2, ep=2)
    mesh_dims_group(mesh, ("dp", "ep"))
    _SURVIVORS.append(mesh)
    return os.getpid()


def _group_of_an_equal_mesh_in_a_new_world() -> tuple[int, list[int], str]:
    survivor = _SURVIVORS.pop()
    mesh = init_mesh(dp=2, ep=2)
    assert mesh == survivor  # DeviceMesh compares by value: the old world's groups must not carry over
    group, size, rank = mesh_dims_group(mesh, ("dp", "ep"))
    assert (size, rank) == (4, dist.get_rank())
    # Both raise for a group of a destroyed world ("not initialized in the world group map").
    return os.getpid(), dist.get_process_group_ranks(group), str(dist.get_backend(group))


def test_an_equal_mesh_of_a_later_world_gets_groups_of_that_world():
    # Fresh ranks: ranks that earlier tests left with many process-group threads are recycled after
    # a run (RECYCLE_AFTER_THREADS), which between these two runs would drop the surviving mesh.
    shutdown_rank_pool()
    first = run_on_ranks(_make_and_keep_a_dp_ep_mesh, 4)
    second = run_on_ranks(_group_of_an_equal_mesh_in_a_new_world, 4)
    # The same pooled processes ran both worlds; otherwise this test would not test anything.
    assert [pid for pid, _, _ in second] == first
    assert all(ranks == [0, 1, 2, 3] and backend == "gloo" for _, ranks, backend in second)
