"""A checkpoint saved under one (dp size, ZeRO stage) loads under another, bitwise.

Each case trains a tiny MLP for ``SAVE_STEPS`` steps under the saving layout, saves model and
optimizer with ``vescale.dcheckpoint.save`` (the optimizer as
``DistributedOptimizer.checkpoint_view()``: state keyed by the model's parameters, dp-sharded
DTensors), then a fresh model and optimizer under the loading layout load it with
``vescale.dcheckpoint.load`` and take one more step. Compared quantities:

* the loaded global state (model parameters and ``DistributedOptimizer.state_dict()``: full
  tensors per FQN) against the saved one: **bitwise** (``torch.equal``), since saving and
  loading only move bytes;
* the saved state against the single-device reference's after the same steps, and the
  parameters after the extra step against the reference's next step: **bitwise**. Every run
  is in deterministic mode, so DP and ZeRO 0-3 do the arithmetic of one process that
  accumulates the dp micro-batches' gradients in rank order and divides by dp once (see
  ``packages/doptim/tests/test_doptim_deterministic.py``); the reference does that with the
  saving run's dp for the first steps and the loading run's dp for the last.

``head`` has 5 outputs, so its rows split unevenly over 4 ranks (FSDP2's padding, uneven
dp shards in the checkpoint), and the buckets are small (several per model, parameters
straddling ZeRO chunks). The ``small`` case adds parameters with fewer elements than dp (3
and 1) and gives every parameter a bucket of its own (``TINY_BUCKET_MB``), so at dp=4 some
ranks own no element of a bucket (empty masters, empty optimizer state, empty dp shards in
the checkpoint view) and FSDP2 leaves some ranks empty shards: every rank must still take
part in every collective with the same tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale.dcheckpoint import load, save
from vescale.doptim import DistributedOptimizer, data_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

SAVE_STEPS = 3
MICRO_BATCH = 3
BUCKET_MB = 400 / 2**20
# 4 bytes: less than any parameter, so each parameter gets a bucket of its own.
TINY_BUCKET_MB = 4 / 2**20


class TinyMLP(torch.nn.Module):
    """Two blocks in a ModuleList (ZeRO-3's FSDP2 units) and a head with an odd width; ``small``
    adds a per-output ``scale`` of 3 elements and a 1-element ``gain``."""

    def __init__(self, small: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()),
                torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh()),
            ]
        )
        self.head = torch.nn.Linear(12, 5)
        self.small = small
        if small:
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
            self.gain = torch.nn.Parameter(torch.full((1,), 0.9))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = block(inputs)
        outputs = self.head(inputs)
        if self.small:
            outputs = torch.cat([outputs[:, :3] * self.scale, outputs[:, 3:]], dim=1) * self.gain
        return outputs


def build_mlp(small: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyMLP(small)


def micro_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO_BATCH, 8, generator=generator), torch.randn(MICRO_BATCH, 5, generator=generator)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference(save_dp: int, load_dp: int, small: bool) -> tuple[dict, dict, dict]:
    """Parameters and AdamW state after ``SAVE_STEPS`` steps at ``save_dp``, parameters after one more
    at ``load_dp``: each step accumulates the dp micro-batches' gradients in rank order, divides once."""
    torch.set_num_threads(1)
    model = build_mlp(small)
    optimizer = make_optimizer(model)
    saved_params = saved_state = None
    for step, dp_size in enumerate([save_dp] * SAVE_STEPS + [load_dp]):
        if step == SAVE_STEPS:
            saved_params = {name: param.detach().clone() for name, param in model.named_parameters()}
            saved_state = {
                name: {key: value.clone() for key, value in optimizer.state[param].items()}
                for name, param in model.named_parameters()
            }
        optimizer.zero_grad()
        for rank in range(dp_size):
            inputs, targets = micro_batch(step, rank)
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        for param in model.parameters():
            param.grad.div_(dp_size)
        optimizer.step()
    final_params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return saved_params, saved_state, final_params


def _parallel(zero_stage: int, small: bool) -> tuple[torch.nn.Module, DistributedOptimizer]:
    model = build_mlp(small)
    options = {} if zero_stage == 3 else {"bucket_size_mb": TINY_BUCKET_MB if small else BUCKET_MB}
    mesh = init_mesh(dp=dist.get_world_size())
    data_parallel(model, mesh, zero_stage=zero_stage, deterministic=True, **options)
    return model, DistributedOptimizer(make_optimizer(model))


def _train_step(model: torch.nn.Module, optimizer: DistributedOptimizer, step: int) -> None:
    optimizer.zero_grad()
    inputs, targets = micro_batch(step, dist.get_rank())
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def _global_state(model: torch.nn.Module, optimizer: DistributedOptimizer) -> tuple[dict, dict]:
    params = {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in model.named_parameters()
    }
    return params, optimizer.state_dict()["state"]


def train_and_save(zero_stage: int, path: str, small: bool) -> tuple[dict, dict]:
    model, optimizer = _parallel(zero_stage, small)
    for step in range(SAVE_STEPS):
        _train_step(model, optimizer, step)
    save(path, {"model": model, "optimizer": optimizer.checkpoint_view()})
    return _global_state(model, optimizer)


def load_and_step(zero_stage: int, path: str, small: bool) -> tuple[dict, dict, dict]:
    model, optimizer = _parallel(zero_stage, small)
    load(path, {"model": model, "optimizer": optimizer.checkpoint_view()})
    loaded_params, loaded_state = _global_state(model, optimizer)
    _train_step(model, optimizer, SAVE_STEPS)
    return loaded_params, loaded_state, _global_state(model, optimizer)[0]


def _assert_bitwise(actual: dict, expected: dict, what: str) -> None:
    assert set(actual) == set(expected), what
    for name, value in expected.items():
        if isinstance(value, dict):
            _assert_bitwise(actual[name], value, f"{what} {name}")
            continue
        difference = (actual[name].float() - value.float()).abs().max().item()
        assert torch.equal(actual[name], value), (what, name, difference)


@pytest.mark.parametrize(
    ("save_dp", "save_stage", "load_dp", "load_stage", "small"),
    [(2, 1, 4, 3, False), (2, 2, 1, 0, False), (4, 3, 2, 1, False), (4, 2, 4, 3, True)],
    ids=[
        "dp2-zero1-to-dp4-zero3",
        "dp2-zero2-to-dp1-zero0",
        "dp4-zero3-to-dp2-zero1",
        "small-dp4-zero2-to-zero3",
    ],
)
def test_checkpoint_reshards_across_dp_size_and_zero_stage(
    tmp_path, save_dp, save_stage, load_dp, load_stage, small
):
    reference_params, reference_state, reference_next = reference(save_dp, load_dp, small)
    path = str(tmp_path / "step-3")
    saved = run_on_ranks(train_and_save, world_size=save_dp, args=(save_stage, path, small), timeout_s=240)
    saved_params, saved_state = saved[0]
    _assert_bitwise(saved_params, reference_params, "saved parameters vs reference")
    _assert_bitwise(saved_state, reference_state, "saved optimizer state vs reference")
    results = run_on_ranks(load_and_step, world_size=load_dp, args=(load_stage, path, small), timeout_s=240)
    for loaded_params, loaded_state, next_params in results:
        _assert_bitwise(loaded_params, saved_params, "loaded parameters vs saved")
        _assert_bitwise(loaded_state, saved_state, "loaded optimizer state vs saved")
        _assert_bitwise(next_params, reference_next, "parameters after one more step vs reference")
