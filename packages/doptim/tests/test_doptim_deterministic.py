"""Deterministic mode: DP and ZeRO 0-3 training bitwise equal to one process accumulating gradients.

Reference, defined exactly: one process, one thread, the same model and seed; at each step
it runs the dp micro-batches (rank 0's slice first, then rank 1's, ...) through backward
without zeroing in between, so autograd accumulates ``((g_0 + g_1) + g_2) + ...``, divides
the accumulated gradients by dp once, and steps ``torch.optim.AdamW``. Deterministic DDP sums
the ranks' gradients in the same rank order and divides by dp
(:mod:`vescale.doptim.reduction`; under ZeRO-3 FSDP2's reduce-scatter is replaced by the same
rank-ordered sum), and AdamW is element-wise, so stepping a ZeRO range or an FSDP2 shard of a
parameter does the reference's arithmetic on those elements: the parameters after 10 steps
must be bitwise equal (``torch.equal``).

The optimizer state: deterministic ZeRO-1 reproduces the reference bitwise, so its
``state_dict()`` (global tensors per FQN) must equal the reference AdamW's state bitwise;
loaded into a ZeRO-2 optimizer with other buckets and saved again, it must come back unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale.doptim import DataParallelConfigError, DistributedOptimizer, data_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

STEPS = 10
MICRO_BATCH = 3
BUCKET_MB = 400 / 2**20


def build_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 12),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 4),
    )


def micro_batches(dp_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(1)
    return [
        [
            (
                torch.randn(MICRO_BATCH, 8, generator=generator),
                torch.randn(MICRO_BATCH, 4, generator=generator),
            )
            for _ in range(dp_size)
        ]
        for _ in range(STEPS)
    ]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def accumulation_reference(dp_size: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model = build_mlp()
    optimizer = make_optimizer(model)
    for step_batches in micro_batches(dp_size):
        optimizer.zero_grad()
        for inputs, targets in step_batches:
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        for param in model.parameters():
            param.grad.div_(dp_size)
        optimizer.step()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def deterministic_training(zero_stage: int) -> dict[str, torch.Tensor]:
    dp_size, rank = dist.get_world_size(), dist.get_rank()
    model = build_mlp()
    options = {} if zero_stage == 3 else {"bucket_size_mb": BUCKET_MB}
    data_parallel(model, init_mesh(dp=dp_size), zero_stage=zero_stage, deterministic=True, **options)
    optimizer = DistributedOptimizer(make_optimizer(model))
    for step_batches in micro_batches(dp_size):
        optimizer.zero_grad()
        inputs, targets = step_batches[rank]
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in model.named_parameters()
    }


def deterministic_training_all_stages() -> dict[int, dict[str, torch.Tensor]]:
    """One rank run for the four stages (one pool start-up instead of four)."""
    return {zero_stage: deterministic_training(zero_stage) for zero_stage in (0, 1, 2, 3)}


@pytest.mark.parametrize("dp_size", [2, 4])
def test_deterministic_training_is_bitwise_equal_to_gradient_accumulation(dp_size):
    reference = accumulation_reference(dp_size)
    for per_stage in run_on_ranks(deterministic_training_all_stages, world_size=dp_size):
        for zero_stage, params in per_stage.items():
            for name, expected in reference.items():
                difference = (params[name] - expected).abs().max().item()
                assert torch.equal(params[name], expected), (zero_stage, name, difference)


def zero3_refuses_buckets() -> str:
    try:
        data_parallel(build_mlp(), init_mesh(dp=2), zero_stage=3, deterministic=True, bucket_size_mb=1)
    except DataParallelConfigError as error:
        return str(error)
    return "no error"


def test_zero3_names_the_options_it_does_not_take():
    message = run_on_ranks(zero3_refuses_buckets, world_size=2)[0]
    assert "zero_stage=3 runs on FSDP2, which has no gradient buckets" in message
    assert "['bucket_size_mb']" in message and "deterministic=True is the only option" in message


STATE_STEPS = 3


def reference_state() -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    model = build_mlp()
    optimizer = make_optimizer(model)
    for step_batches in micro_batches(2)[:STATE_STEPS]:
        optimizer.zero_grad()
        for inputs, targets in step_batches:
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        for param in model.parameters():
            param.grad.div_(2)
        optimizer.step()
    return {name: dict(optimizer.state[param]) for name, param in model.named_parameters()}


def saved_and_reloaded() -> tuple[dict, dict]:
    rank = dist.get_rank()
    model = build_mlp()
    data_parallel(model, init_mesh(dp=2), zero_stage=1, bucket_size_mb=BUCKET_MB, deterministic=True)
    optimizer = DistributedOptimizer(make_optimizer(model))
    for step_batches in micro_batches(2)[:STATE_STEPS]:
        optimizer.zero_grad()
        inputs, targets = step_batches[rank]
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    saved = optimizer.state_dict()
    other = build_mlp()
    data_parallel(other, init_mesh(dp=2), zero_stage=2, bucket_size_mb=BUCKET_MB / 2)
    reloaded = DistributedOptimizer(make_optimizer(other))
    reloaded.load_state_dict(saved)
    return saved, reloaded.state_dict()


def test_state_dict_is_global_per_fqn_and_reloads_under_another_stage():
    reference = reference_state()
    for saved, resaved in run_on_ranks(saved_and_reloaded, world_size=2):
        assert set(saved["state"]) == set(reference)
        assert saved["param_groups"][0]["params"] == list(reference)
        for fqn, expected in reference.items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(saved["state"][fqn][name], expected[name]), (fqn, name)
                assert torch.equal(resaved["state"][fqn][name], expected[name]), (fqn, name)
