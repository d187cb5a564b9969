"""``DistributedOptimizer.checkpoint_view()``: the state keyed by model parameter, dp-sharded DTensors.

What a parameter-keyed checkpoint does with the view, done by hand on dp=2: read
``view.state[param]`` (each element-wise tensor a DTensor of the parameter's global shape,
``Shard`` over dp; its ``full_tensor()`` must equal ``state_dict()``'s global tensor bitwise,
since building the view only moves bytes), then write every parameter's full state and the
group hyper-parameters into the view of a fresh optimizer under another stage and bucket
size: its ``state_dict()`` must then equal the saved one bitwise, and the hyper-parameter
must reach the optimizer's own group (where LR schedulers and ``step`` read it). The model has
a 0-dim parameter (``gain``), whose ``exp_avg`` is as 0-dim as AdamW's ``step``: loaded, it must
still be stepped as element-wise state (one more step on the reloaded optimizer).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from vescale.doptim import DistributedOptimizer, data_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

BUCKET_MB = 400 / 2**20


class ScaledMLP(torch.nn.Sequential):
    """An MLP whose output is scaled by a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
        self.gain = torch.nn.Parameter(torch.tensor(0.9))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return super().forward(inputs) * self.gain


def build_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return ScaledMLP()


def _train_step(model: torch.nn.Module, optimizer: DistributedOptimizer, generator: torch.Generator) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, 8, generator=generator)).square().mean().backward()
    optimizer.step()


def _trained(zero_stage: int) -> tuple[torch.nn.Module, DistributedOptimizer]:
    model = build_mlp()
    data_parallel(model, init_mesh(dp=2), zero_stage=zero_stage, bucket_size_mb=BUCKET_MB)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        _train_step(model, optimizer, generator)
    return model, optimizer


def view_round_trip(save_stage: int, load_stage: int) -> dict:
    model, optimizer = _trained(save_stage)
    saved = optimizer.state_dict()
    view = optimizer.checkpoint_view()
    layouts, full_state = {}, {}
    for name, param in model.named_parameters():
        assert any(param is view_param for view_param in view.param_groups[0]["params"])
        exp_avg = view.state[param]["exp_avg"]
        layouts[name] = (type(exp_avg), tuple(exp_avg.shape), exp_avg.placements)
        full_state[name] = {
            key: value.full_tensor() if isinstance(value, DTensor) else value
            for key, value in view.state[param].items()
        }
    other = build_mlp()
    data_parallel(other, init_mesh(dp=2), zero_stage=load_stage, bucket_size_mb=BUCKET_MB / 2)
    reloaded = DistributedOptimizer(torch.optim.AdamW(other.parameters(), lr=1e-3))
    other_view = reloaded.checkpoint_view()
    params = dict(other.named_parameters())
    for name, param_state in full_state.items():
        other_view.state[params[name]] = param_state
    other_view.param_groups[0].update({"lr": 5e-3})
    reloaded_state = reloaded.state_dict()
    _train_step(other, reloaded, torch.Generator().manual_seed(dist.get_rank()))
    return {
        "saved": saved,
        "full_state": full_state,
        "layouts": layouts,
        "reloaded": reloaded_state,
        "gain_exp_avg_shape": tuple(reloaded.state_dict()["state"]["gain"]["exp_avg"].shape),
        "lr": reloaded.param_groups[0]["lr"],
    }


@pytest.mark.parametrize(("save_stage", "load_stage"), [(1, 2), (2, 0)])
def test_checkpoint_view_is_dp_sharded_and_writes_through(save_stage, load_stage):
    for result in run_on_ranks(view_round_trip, world_size=2, args=(save_stage, load_stage)):
        assert result["layouts"]["0.weight"] == (DTensor, (16, 8), (Shard(0),))
        assert result["layouts"]["2.bias"] == (DTensor, (5,), (Shard(0),))
        for fqn, saved_state in result["saved"]["state"].items():
            for name, value in saved_state.items():
                assert torch.equal(result["full_state"][fqn][name], value), (fqn, name)
                assert torch.equal(result["reloaded"]["state"][fqn][name], value), (fqn, name)
        assert result["lr"] == 5e-3
        assert result["gain_exp_avg_shape"] == ()
