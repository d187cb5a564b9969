"""init_mesh builds named meshes in canonical order and refuses impossible ones clearly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vescale.dtensor as vdt
from vescale.dtensor import MeshError, device_type_for_backend, init_mesh
from vescale.dtensor.testing import run_on_ranks


def describe_mesh(dims: dict[str, int]) -> tuple:
    mesh = init_mesh(**dims)
    groups = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in mesh.mesh_dim_names}
    return mesh.device_type, mesh.mesh_dim_names, tuple(mesh.shape), mesh.mesh.tolist(), groups


def init_mesh_error(dims: dict[str, int]) -> str:
    with pytest.raises(MeshError) as raised:
        init_mesh(**dims)
    return str(raised.value)


def distribute_and_gather(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mesh = init_mesh(dp=2, tp=2)
    sharded = vdt.distribute_tensor(full, mesh, [vdt.Replicate(), vdt.Shard(1)])
    rebuilt = vdt.from_local(sharded.to_local(), mesh, [vdt.Replicate(), vdt.Shard(1)])
    return sharded.to_local(), rebuilt.full_tensor()


def test_dims_are_ordered_pp_dp_ep_tp_whatever_order_they_are_given_in():
    for dims in ({"tp": 2, "dp": 2}, {"dp": 2, "tp": 2}):
        results = run_on_ranks(describe_mesh, world_size=4, args=(dims,))
        device_type, names, shape, layout, groups = results[1]
        assert (device_type, names, shape, layout) == ("cpu", ("dp", "tp"), (2, 2), [[0, 1], [2, 3]])
        assert groups == {"dp": [1, 3], "tp": [0, 1]}


def test_size_one_dims_are_kept_on_the_mesh():
    results = run_on_ranks(describe_mesh, world_size=4, args=({"tp": 2, "pp": 1, "dp": 2, "ep": 1},))
    _, names, shape, _, groups = results[3]
    assert names == ("pp", "dp", "ep", "tp")
    assert shape == (1, 2, 1, 2)
    assert groups == {"pp": [3], "dp": [1, 3], "ep": [3], "tp": [2, 3]}


def test_dims_that_do_not_multiply_to_the_world_size_are_named_in_the_error():
    message = run_on_ranks(init_mesh_error, world_size=4, args=({"dp": 3, "tp": 2},))[0]
    assert message == (
        "init_mesh(dp=3, tp=2): the dimensions dp, tp multiply to 6, but the world has 4 processes; "
        "choose sizes whose product is 4"
    )


def test_unknown_names_and_bad_sizes_are_refused_with_the_fix():
    messages = run_on_ranks(init_mesh_error, world_size=2, args=({"dp": 1, "cp": 2},))
    assert "unknown mesh dimension 'cp'; use the names pp, dp, ep, tp" in messages[0]
    messages = run_on_ranks(init_mesh_error, world_size=2, args=({"dp": 0, "tp": 2},))
    assert "the size of 'dp' must be a positive integer" in messages[0]


def test_init_mesh_without_a_process_group_says_how_to_start_one():
    assert not dist.is_initialized()
    with pytest.raises(MeshError, match=r"call torch\.distributed\.init_process_group"):
        init_mesh(dp=1)


def test_device_type_follows_the_backend():
    assert device_type_for_backend("gloo") == "cpu"
    assert device_type_for_backend("cpu:gloo,cuda:nccl") == (
        "cuda" if torch.accelerator.is_available() else "cpu"
    )
    assert device_type_for_backend("nccl") == "cuda"
    with pytest.raises(MeshError, match=r"backend 'bogus'.*device_type='cuda'"):
        device_type_for_backend("bogus")


def test_reexported_dtensor_api_shards_and_rebuilds_the_single_device_tensor():
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    results = run_on_ranks(distribute_and_gather, world_size=4, args=(full,))
    for rank, (local, rebuilt) in enumerate(results):
        tp_rank = rank % 2
        assert torch.equal(local, full[:, 3 * tp_rank : 3 * tp_rank + 3])
        assert torch.equal(rebuilt, full)
    assert vdt.DTensor is torch.distributed.tensor.DTensor


def test_gloo_means_cpu_on_a_machine_with_an_accelerator(monkeypatch):
    # torch maps gloo to "mps" as well as "cpu": on a CUDA machine a gloo mesh once came out on
    # "mps", and init_device_mesh failed inside torch (torch.mps has no is_initialized).
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    assert device_type_for_backend("gloo") == "cpu"
    assert device_type_for_backend("cpu:gloo,cuda:nccl") == "cuda"
    assert device_type_for_backend("nccl") == "cuda"


def meshes_of_two_models() -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    first, again, other = init_mesh(dp=2, tp=2), init_mesh(tp=2, dp=2), init_mesh(dp=4)
    # A second model's parameters, some made through DTensor ops whose cached sharding decisions
    # hold the first model's mesh: one mesh object, which FSDP2 needs.
    weights = [distribute_tensor(torch.ones(4, 4), first, [Replicate(), Shard(0)]) for _ in range(2)]
    doubled = weights[0] * 2
    second = distribute_tensor(torch.ones(4, 4), again, [Replicate(), Shard(0)]) * 2
    return {
        "same object": first is again,
        "other dims, other mesh": other is not first,
        "op outputs on it": doubled.device_mesh is first and second.device_mesh is again,
    }


def test_the_same_dims_give_the_same_mesh_object():
    for rank, results in enumerate(run_on_ranks(meshes_of_two_models, world_size=4)):
        assert all(results.values()), (rank, results)
