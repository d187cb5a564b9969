"""Model, optimizer, scheduler, random-number and extra state: saved, resharded, resumed.

Optimizer state is compared bitwise with a single-process Adam on the full tensors: the
gradients are set, not computed, and Adam is elementwise, so a shard's arithmetic is the
reference's arithmetic on the same elements. Resumed training is compared bitwise with
uninterrupted training of the same model, data and seed (dropout on, so that the restored
random-number state matters).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from vescale.dcheckpoint.api import load, save
from vescale.dcheckpoint.errors import CheckpointMismatchError
from vescale.dcheckpoint.rng import RNGState
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.placements import distribute_tensor
from vescale.dtensor.testing import run_on_ranks

PARAM_SHAPES = {"fused": (12, 4), "weight": (6, 5), "bias": (6,)}
# (world size, mesh shape, placements per parameter)
OPTIMIZER_LAYOUTS = {
    "mesh2": (2, (2,), {"fused": ["IS(0,3)"], "weight": ["S(1)"], "bias": ["R"]}),
    "mesh1": (1, (1,), {"fused": ["R"], "weight": ["R"], "bias": ["R"]}),
    "mesh4": (4, (4,), {"fused": ["S(1)"], "weight": ["S(0)"], "bias": ["S(0)"]}),
    "mesh2x2": (4, (2, 2), {"fused": ["S(1)", "IS(0,3)"], "weight": ["R", "S(1)"], "bias": ["S(0)", "R"]}),
}
STEPS = 2


def reference_inputs() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(7)
    params = {name: torch.randn(shape, generator=generator) for name, shape in PARAM_SHAPES.items()}
    grads = [
        {name: torch.randn(shape, generator=generator) for name, shape in PARAM_SHAPES.items()}
        for _ in range(STEPS)
    ]
    return params, grads


class ParamHolder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor))


def _holder_and_optimizer(mesh_shape, placements, params):
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), mesh_shape)
    holder = ParamHolder(
        {name: distribute_tensor(value, mesh, placements[name]) for name, value in params.items()}
    )
    optimizer = torch.optim.Adam(holder.parameters(), lr=0.1, betas=(0.8, 0.9), foreach=False)
    return mesh, holder, optimizer


def train_and_save_on_ranks(directory, mesh_shape, placements, params, grads) -> None:
    mesh, holder, optimizer = _holder_and_optimizer(mesh_shape, placements, params)
    for step_grads in grads:
        for name, param in holder.named_parameters():
            param.grad = distribute_tensor(step_grads[name], mesh, placements[name])
        optimizer.step()
    save(directory, {"model": holder, "optimizer": optimizer})


def load_optimizer_on_ranks(directory, mesh_shape, placements, params) -> dict:
    _, holder, optimizer = _holder_and_optimizer(
        mesh_shape, placements, {k: torch.zeros_like(v) for k, v in params.items()}
    )
    load(directory, {"model": holder, "optimizer": optimizer})
    full = {}
    for name, param in holder.named_parameters():
        full[name] = param.detach().full_tensor()
        for key, value in optimizer.state[param].items():
            full[f"{name}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
            full[f"{name}.{key}.placements"] = (
                str(value.placements) if isinstance(value, DTensor) else "plain"
            )
        full[f"{name}.placements"] = str(param.placements)
    full["lr"] = optimizer.param_groups[0]["lr"]
    full["betas"] = optimizer.param_groups[0]["betas"]
    return full


def reference_adam(params, grads) -> dict:
    holder = ParamHolder({name: value.clone() for name, value in params.items()})
    optimizer = torch.optim.Adam(holder.parameters(), lr=0.1, betas=(0.8, 0.9), foreach=False)
    for step_grads in grads:
        for name, param in holder.named_parameters():
            param.grad = step_grads[name].clone()
        optimizer.step()
    expected = {}
    for name, param in holder.named_parameters():
        expected[name] = param.detach()
        for key, value in optimizer.state[param].items():
            expected[f"{name}.{key}"] = value
    return expected


@pytest.mark.parametrize("save_layout", ["mesh2", "mesh2x2"])
def test_adam_state_reshards_bitwise_into_every_layout(tmp_path, save_layout):
    params, grads = reference_inputs()
    expected = reference_adam(params, grads)
    world_size, mesh_shape, placements = OPTIMIZER_LAYOUTS[save_layout]
    run_on_ranks(
        train_and_save_on_ranks,
        world_size,
        args=(str(tmp_path / "ckpt"), mesh_shape, placements, params, grads),
    )
    for load_layout, (world_size, mesh_shape, placements) in OPTIMIZER_LAYOUTS.items():
        for rank, loaded in enumerate(
            run_on_ranks(
                load_optimizer_on_ranks,
                world_size,
                args=(str(tmp_path / "ckpt"), mesh_shape, placements, params),
            )
        ):
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), f"{save_layout} -> {load_layout} rank {rank}: {key}"
            for name in PARAM_SHAPES:
                # Moment estimates keep the parameter's layout, as torch's Adam keeps them.
                assert loaded[f"{name}.exp_avg.placements"] == loaded[f"{name}.placements"]
                assert loaded[f"{name}.step.placements"] == "plain"
            assert (loaded["lr"], loaded["betas"]) == (0.1, (0.8, 0.9))


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 16)
        self.dropout = nn.Dropout(0.3)
        self.out = nn.Linear(16, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.out(self.dropout(torch.relu(self.hidden(inputs))))


def _train(state, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        # Data drawn from the global generator too, so that it must be restored as well.
        inputs = torch.randn(4, 6)
        loss = state["model"](inputs).square().mean()
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()
        state["lr_scheduler"].step()
        state["step"] += 1
        losses.append(loss.item())
    return losses


def _fresh_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = DropoutNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler, "rng": RNGState(), "step": 0}


def test_resumed_training_continues_with_bitwise_the_uninterrupted_losses(tmp_path):
    torch.set_num_threads(1)
    uninterrupted = _fresh_state(seed=3)
    expected = _train(uninterrupted, 6)

    first = _fresh_state(seed=3)
    assert _train(first, 3) == expected[:3]
    save(tmp_path / "step-3", first)
    _train(first, 2)  # moves weights, optimizer, scheduler and generators on after the save

    resumed = _fresh_state(seed=99)
    load(tmp_path, resumed)
    assert resumed["step"] == 3
    assert _train(resumed, 3) == expected[3:]
    assert resumed["lr_scheduler"].get_last_lr() == uninterrupted["lr_scheduler"].get_last_lr()


def draw_after_save_on_ranks(directory: str) -> tuple[list[float], list[float]]:
    torch.manual_seed(100 + dist.get_rank())
    random.seed(dist.get_rank())
    np.random.seed(dist.get_rank())
    save(directory, {"rng": RNGState()})
    expected = [torch.rand(1).item(), random.random(), float(np.random.rand())]
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    load(directory, {"rng": RNGState()})
    return expected, [torch.rand(1).item(), random.random(), float(np.random.rand())]


def test_every_rank_gets_its_own_generators_back(tmp_path):
    results = run_on_ranks(draw_after_save_on_ranks, 2, args=(str(tmp_path / "ckpt"),))
    for expected, drawn in results:
        assert drawn == expected
    assert results[0][0] != results[1][0]


def test_extras_and_stateful_objects_round_trip_exactly(tmp_path):
    extras = {"epoch": 3, "history": [1.5, float("inf")], "pair": (1, "a"), "by_id": {7: torch.arange(5)}}
    save(tmp_path / "ckpt", {"extras": extras, "note": "text"})
    state = {"extras": None, "note": None}
    load(tmp_path / "ckpt", state)
    assert state["note"] == "text"
    assert state["extras"]["pair"] == (1, "a") and state["extras"]["history"] == [1.5, float("inf")]
    assert torch.equal(state["extras"]["by_id"][7], torch.arange(5))


def test_missing_and_unexpected_keys_are_refused_unless_not_strict(tmp_path):
    save(tmp_path / "ckpt", {"model": nn.Linear(3, 2)})
    bigger = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"missing 'model/0.bias', 'model/0.weight'.*unexpected "
        r"'model/bias', 'model/weight'.*strict=False",
    ):
        load(tmp_path / "ckpt", {"model": bigger})
    with pytest.raises(CheckpointMismatchError, match=r"the checkpoint has no 'step'.*strict=False"):
        load(tmp_path / "ckpt", {"model": nn.Linear(3, 2), "step": 0})
    state = {"model": nn.Linear(3, 2), "step": 0}
    load(tmp_path / "ckpt", state, strict=False)
    assert state["step"] == 0
    with pytest.raises(CheckpointMismatchError, match=r"'model/bias'.*shape \(2,\).*shape \(4,\)"):
        load(tmp_path / "ckpt", {"model": nn.Linear(3, 4)})
    with pytest.raises(CheckpointMismatchError, match=r"'model/bias'.*torch.float32.*torch.float64"):
        load(tmp_path / "ckpt", {"model": nn.Linear(3, 2).double()})
