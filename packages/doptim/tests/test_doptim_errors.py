"""Bad input gets a typed error (a DOptimError) that names the offending item and the fix."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from vescale.doptim import (
    DDP,
    DataParallelConfigError,
    DataParallelMeshError,
    DistributedOptimizer,
    DOptimError,
    OptimizerOrderError,
    data_parallel,
)
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks


def error_messages() -> dict[str, str]:
    messages = {}

    def capture(key, call, error_type):
        try:
            call()
        except error_type as error:
            assert isinstance(error, DOptimError)
            messages[key] = str(error)

    capture("mesh_dim", lambda: DDP(torch.nn.Linear(2, 2), init_mesh(tp=2)), DataParallelMeshError)
    sharded_over_dp = torch.nn.Linear(4, 4)
    sharded_over_dp.weight = torch.nn.Parameter(
        distribute_tensor(sharded_over_dp.weight.detach(), init_mesh(dp=2), [Shard(0)])
    )
    capture("dp_sharded", lambda: DDP(sharded_over_dp, init_mesh(dp=2)), DataParallelMeshError)
    other_mesh = torch.nn.Linear(4, 4)
    other_mesh.weight = torch.nn.Parameter(
        distribute_tensor(other_mesh.weight.detach(), init_mesh(tp=2), [Shard(0)])
    )
    capture("wrong_mesh", lambda: DDP(other_mesh, init_mesh(dp=2)), DataParallelMeshError)
    half_distributed = torch.nn.Linear(4, 4)
    half_distributed.weight = torch.nn.Parameter(
        distribute_tensor(half_distributed.weight.detach(), init_mesh(dp=2), [Replicate()])
    )
    capture(
        "zero3_plain",
        lambda: data_parallel(half_distributed, init_mesh(dp=2), zero_stage=3),
        DataParallelMeshError,
    )
    model = torch.nn.Linear(2, 2)
    early_optimizer = torch.optim.AdamW(model.parameters())
    capture("order", lambda: DistributedOptimizer(early_optimizer), OptimizerOrderError)
    capture("stage", lambda: data_parallel(model, init_mesh(dp=2), zero_stage=5), DataParallelConfigError)
    data_parallel(model, init_mesh(dp=2))
    capture("twice", lambda: data_parallel(model, init_mesh(dp=2)), DataParallelConfigError)
    return messages


def test_errors_name_the_problem_and_the_fix():
    messages = run_on_ranks(error_messages, world_size=2)[0]
    assert "mesh_dim='dp' is not a dimension of the mesh (its dims: ('tp',))" in messages["mesh_dim"]
    assert "parameter 'weight' is S(0) on the data-parallel mesh dim 0" in messages["dp_sharded"]
    assert "zero_stage=3" in messages["dp_sharded"]
    assert "parameter 'weight' lives on" in messages["wrong_mesh"]
    assert "parallelize the model on the same mesh" in messages["wrong_mesh"]
    assert (
        "param_groups[0]['params'][0] (shape (2, 2)) is not a parameter of a data-parallel model"
        in (messages["order"])
    )
    assert "Apply the stage first, then build the optimizer" in messages["order"]
    assert "zero_stage must be one of (0, 1, 2, 3), not 5" in messages["stage"]
    assert "data-parallel already" in messages["twice"]
    assert "parameter 'bias' is a plain tensor while others are DTensors" in messages["zero3_plain"]
    assert "parallelize the whole model" in messages["zero3_plain"]
