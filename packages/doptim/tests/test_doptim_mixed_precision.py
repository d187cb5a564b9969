"""ZeRO-3 mixed precision (bf16 compute, fp32 master weights and optimizer state) against one process.

The single-process bf16 recipe, written out: fp32 master weights and fp32 AdamW; each step
casts the masters to a bf16 copy of the model, runs every dp rank's micro-batch through it
in turn (bf16 forward and backward, bf16 inputs and targets), casts each micro-batch's bf16
gradient to fp32, sums them in rank order 0, 1, ..., divides by dp once and steps AdamW on
the masters. That is what ``data_parallel(..., zero_stage=3, compute_dtype=torch.bfloat16)``
does: FSDP2 all-gathers the fp32 shards cast to bf16, computes each rank's micro-batch in
bf16 and reduce-scatters the gradients cast to fp32.

* deterministic mode (the rank-ordered reduce-scatter), no clipping: the fp32 arithmetic is
  the reference's element by element, so the compared quantity, every master weight after
  10 steps, must be **bitwise** equal (``torch.equal``);
* default mode with clipping: FSDP2's reduce-scatter sums in the backend's order and the
  clipping norm is summed over shards, both fp32 roundings (~1e-7 relative per step; the bf16
  compute is identical on both sides, so none of bf16's 4e-3 rounding enters the
  difference), within 1e-5 relative after 10 steps as in the fp32 tests.

Both runs also check that the parameters and optimizer state are fp32 and the compute bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from vescale.doptim import DataParallelConfigError, DistributedOptimizer, clip_grad_norm_, data_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.mlp import build_tiny_mlp, mlp_batches

STEPS = 10
MICRO_BATCH = 2
MAX_NORM = 0.05  # below the early gradient norms, so clipping really scales them
PARAM_RTOL = 1e-5


def micro_batches(dp_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, one bf16 micro-batch per dp rank, in rank order."""
    pieces = mlp_batches(STEPS * dp_size, MICRO_BATCH, dtype=torch.bfloat16)
    return [pieces[step * dp_size : (step + 1) * dp_size] for step in range(STEPS)]


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def bf16_recipe(dp_size: int, clip: bool) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    master = build_tiny_mlp()
    compute = copy.deepcopy(master).to(torch.bfloat16)
    optimizer = make_optimizer(master.parameters())
    for step_batches in micro_batches(dp_size):
        with torch.no_grad():
            for compute_param, master_param in zip(compute.parameters(), master.parameters(), strict=True):
                compute_param.copy_(master_param)
        per_rank = []
        for inputs, targets in step_batches:
            compute.zero_grad()
            torch.nn.functional.mse_loss(compute(inputs), targets).backward()
            per_rank.append([param.grad.float() for param in compute.parameters()])
        for position, param in enumerate(master.parameters()):
            total = per_rank[0][position].clone()
            for grads in per_rank[1:]:
                total.add_(grads[position])
            param.grad = total.div_(dp_size)
        if clip:
            torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.detach().clone() for name, param in master.named_parameters()}


def zero3_bf16_training(deterministic: bool, clip: bool) -> dict:
    dp_size, rank = dist.get_world_size(), dist.get_rank()
    model = build_tiny_mlp()
    data_parallel(
        model, init_mesh(dp=dp_size), zero_stage=3, compute_dtype=torch.bfloat16, deterministic=deterministic
    )
    optimizer = DistributedOptimizer(make_optimizer(model.parameters()))
    output_dtypes = set()
    for step_batches in micro_batches(dp_size):
        optimizer.zero_grad()
        inputs, targets = step_batches[rank]
        outputs = model(inputs)
        output_dtypes.add(outputs.dtype)
        torch.nn.functional.mse_loss(outputs, targets).backward()
        if clip:
            clip_grad_norm_(optimizer, MAX_NORM)
        optimizer.step()
    state_dtypes = {
        value.dtype for state in optimizer.state.values() for value in state.values() if value.dim() >= 1
    }
    return {
        "params": {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()},
        "param_dtypes": {param.dtype for param in model.parameters()},
        "state_dtypes": state_dtypes,
        "output_dtypes": output_dtypes,
    }


def both_modes() -> tuple[dict, dict]:
    deterministic = zero3_bf16_training(deterministic=True, clip=False)
    return deterministic, zero3_bf16_training(deterministic=False, clip=True)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_zero3_bf16_matches_the_single_process_bf16_recipe(dp_size):
    bitwise_reference = bf16_recipe(dp_size, clip=False)
    clipped_reference = bf16_recipe(dp_size, clip=True)
    for deterministic, default in run_on_ranks(both_modes, world_size=dp_size):
        for run in (deterministic, default):
            assert run["param_dtypes"] == {torch.float32} and run["state_dtypes"] == {torch.float32}
            assert run["output_dtypes"] == {torch.bfloat16}
        for name, expected in bitwise_reference.items():
            difference = (deterministic["params"][name] - expected).abs().max().item()
            assert torch.equal(deterministic["params"][name], expected), (name, difference)
        for name, expected in clipped_reference.items():
            max_abs = (default["params"][name] - expected).abs().max().item()
            relative = max_abs / expected.abs().max().item()
            print(f"dp={dp_size} bf16 zero=3 {name}: max abs {max_abs:.2e}, relative {relative:.2e}")
            assert relative <= PARAM_RTOL, (name, relative)


def compute_dtype_errors() -> list[str]:
    messages = []
    for call in (
        lambda: data_parallel(build_tiny_mlp(), init_mesh(dp=2), zero_stage=1, compute_dtype=torch.bfloat16),
        lambda: data_parallel(
            build_tiny_mlp().to(torch.bfloat16), init_mesh(dp=2), zero_stage=3, compute_dtype=torch.bfloat16
        ),
    ):
        try:
            call()
        except DataParallelConfigError as error:
            messages.append(str(error))
    return messages


def test_compute_dtype_errors_name_the_fix():
    stage_message, dtype_message = run_on_ranks(compute_dtype_errors, world_size=2)[0]
    assert "compute_dtype is for zero_stage=3" in stage_message
    assert "model.to(torch.bfloat16)" in stage_message
    assert "'blocks.0.0.weight' is torch.bfloat16" in dtype_message
    assert "build the model in float32" in dtype_message
