"""A redistribution never moves data across a mesh dim on which the tensor stays Replicate.

Activations are Replicate over the data-parallel dim while each rank holds its own batch. torch
2.13 planned the backward of OPT's flattened sequence-parallel activation, ``(R, Partial) ->
(R, _StridedShard)`` on a dp x tp mesh, as four moves, two of them over dp (strided-shard, then
all-gather), which mixed the two dp ranks' batches: dp2 x tp2 trained OPT 40% off in its
gradients (``_compat.install_replicate_dims_guard``). Here each dp rank holds different data under
the Replicate dp dim, as in training, and the moved tensor must equal what the tp group alone
computes from that rank's data.
"""

from __future__ import annotations

import importlib

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.dtensor import _compat, init_mesh
from vescale.dtensor.testing import run_on_ranks


def partial_to_strided_on_rank() -> dict:
    import vescale.dtensor.ops  # noqa: F401  # installs the guard, as any use of vescale.dtensor does

    redistribute = importlib.import_module("torch.distributed.tensor._redistribute")
    plan_function = redistribute._gen_transform_infos_non_cached
    mesh = init_mesh(dp=2, tp=2)
    dp_rank, tp_rank = mesh.get_coordinate()
    # This dp rank's batch: [b=2, s=8, h=4], sequence-sharded over tp, flattened to tokens.
    batch = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(dp_rank))
    local = batch.chunk(2, dim=1)[tp_rank].contiguous()
    strided = DTensor.from_local(local, mesh, [Replicate(), Shard(1)], run_check=False).reshape(16, 4)
    gradient = torch.randn(16, 4, generator=torch.Generator().manual_seed(10 + dp_rank))
    # The gradient arrives summed over tp (two halves); the backward spec's flag, as torch sets it.
    partial = DTensor.from_local(gradient / 2, mesh, [Replicate(), Partial()], run_check=False)
    target = type(strided._spec)(
        mesh,
        strided.placements,
        tensor_meta=strided._spec.tensor_meta,
        use_strided_shard_as_shard_order=False,
    )
    plan = redistribute._gen_transform_infos(partial._spec, target)
    moved = redistribute.redistribute_local_tensor(partial.to_local(), partial._spec, target)
    expected = gradient.reshape(2, 8, 4).chunk(2, dim=1)[tp_rank].reshape(8, 4)
    return {
        "strided": "StridedShard" in type(strided.placements[1]).__name__,
        "plan leaves dp alone": all(info.mesh_dim == 1 for info in plan),
        "this dp rank's gradient": torch.allclose(moved, expected),
        "guard installed": getattr(plan_function, "vescale_keeps_replicate_dims", False),
    }


def test_partial_to_strided_shard_keeps_each_dp_ranks_batch():
    for rank, results in enumerate(run_on_ranks(partial_to_strided_on_rank, world_size=4)):
        assert all(results.values()), (rank, results)


def test_the_guard_is_idempotent_and_composes_with_the_torch_2_11_fallback():
    redistribute = importlib.import_module("torch.distributed.tensor._redistribute")
    _compat.install_replicate_dims_guard()
    plan = redistribute._gen_transform_infos_non_cached
    _compat.install_replicate_dims_guard()
    _compat.install_strided_shard_greedy_redistribution()
    _compat.install_replicate_dims_guard()
    if _compat.torch_version() >= (2, 13):
        assert redistribute._gen_transform_infos_non_cached is plan
    assert redistribute._gen_transform_infos_non_cached.vescale_keeps_replicate_dims


def strided_moves_on_a_pipeline_mesh_on_rank() -> dict:
    """A fused weight's _StridedShard on a pp x dp x tp mesh (pp2 x tp2, dp of one rank)."""
    import vescale.dtensor.ops  # noqa: F401  # installs the guard

    redistribute = importlib.import_module("torch.distributed.tensor._redistribute")
    strided_shard = _compat.strided_shard_type()
    mesh = init_mesh(pp=2, dp=1, tp=2)
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    fused = DTensor.from_local(full, mesh, [Replicate(), Replicate(), Replicate()], run_check=False)
    weight = fused.redistribute(mesh, [Replicate(), Replicate(), strided_shard(0, split_factor=2)])
    spec = weight._spec
    planner = redistribute.get_redistribute_planner(mesh, spec.tensor_meta)

    def target(*placements: object) -> object:
        return type(spec)(mesh, tuple(placements), tensor_meta=spec.tensor_meta)

    # One mesh dim moves, the others stay Replicate: the greedy plan moves just it.
    gathered = target(Replicate(), Replicate(), Replicate())
    # A candidate that shards over pp and dp: priced (and turned down) without torch's search.
    over_batch_dims = target(strided_shard(1, split_factor=2), Shard(0), Partial())
    searches = []
    planner_class = type(planner)
    search = planner_class.generate_graph_based_transform_infos

    def counted_search(self: object, *args: object) -> object:
        searches.append(args)
        return search(self, *args)

    planner_class.generate_graph_based_transform_infos = counted_search
    try:
        one_dim = redistribute._gen_transform_infos_non_cached(spec, gathered)
        batch_dims = redistribute._gen_transform_infos_non_cached(spec, over_batch_dims)
    finally:
        planner_class.generate_graph_based_transform_infos = search
    return {
        "no search": not searches,
        "one dim: greedy plan": one_dim == planner.generate_greedy_transform_infos(spec, gathered),
        "one dim: the full weight": torch.equal(weight.full_tensor(), full),
        "batch dims: greedy": batch_dims == planner.generate_greedy_transform_infos(spec, over_batch_dims),
    }


def test_strided_moves_on_a_pipeline_mesh_are_planned_greedily():
    # torch searches every placement of every mesh dim for a move with a _StridedShard: 0.6 s per
    # plan on pp x dp x tp, once per new shape (an MoE expert's tokens), minutes per step.
    for rank, results in enumerate(run_on_ranks(strided_moves_on_a_pipeline_mesh_on_rank, world_size=4)):
        assert all(results.values()), (rank, results)
