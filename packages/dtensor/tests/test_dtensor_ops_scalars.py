"""Python numbers read from sharded or Partial DTensors: the single-device answer on every rank.

Compared with the single-process value, exactly (they are booleans and small sums), and,
for ``nn.init.trunc_normal_`` (which branches on ``mask.any()``), bitwise values of the
initialised weight and of the next random draw, which only match when every rank's
generator took the same path.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard, distribute_tensor

import vescale.dtensor.ops  # noqa: F401  (registers the scalar-read handlers)
from vescale.dtensor import init_mesh
from vescale.dtensor.random import manual_seed
from vescale.dtensor.testing import run_on_ranks


def scalar_reads_on_ranks(values: torch.Tensor) -> dict:
    mesh = init_mesh(tp=dist_world_size())
    sharded = distribute_tensor(values, mesh, [Shard(0)])
    return {
        "any": bool((sharded > 0).any()),
        "all": bool((sharded > 0).all()),
        "sum_item": sharded.sum().item(),
        "if_branch": "taken" if (sharded > 0).any() else "skipped",
    }


def dist_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_any_all_and_item_of_shards_agree_with_the_full_tensor():
    values = torch.tensor([0.0, 0.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    for world_size in (2, 4):
        for result in run_on_ranks(scalar_reads_on_ranks, world_size=world_size, args=(values,)):
            assert result == {"any": True, "all": False, "sum_item": 6.0, "if_branch": "taken"}


def trunc_normal_on_ranks(shape: tuple, dim: int) -> dict:
    mesh = init_mesh(tp=dist_world_size())
    manual_seed(0)
    weight = distribute_tensor(torch.empty(shape), mesh, [Shard(dim)])
    torch.nn.init.trunc_normal_(weight, std=1.0, a=-0.5, b=0.5)
    return {"weight": weight.full_tensor(), "next_draw": torch.rand(4)}


def test_trunc_normal_on_shards_is_bitwise_the_single_device_init():
    torch.manual_seed(0)
    reference = torch.empty(64, 8)
    torch.nn.init.trunc_normal_(reference, std=1.0, a=-0.5, b=0.5)
    next_draw = torch.rand(4)
    for dim in (0, 1):
        for result in run_on_ranks(trunc_normal_on_ranks, world_size=2, args=((64, 8), dim)):
            assert torch.equal(result["weight"], reference)
            assert torch.equal(result["next_draw"], next_draw)
