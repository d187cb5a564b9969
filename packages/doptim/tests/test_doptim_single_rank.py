"""Data parallelism over one rank (dp = 1, as under a pipeline- or tensor-only plan) trains as plain PyTorch.

With one rank there is nothing to reduce, so ``DDP`` leaves a plain parameter of the buckets'
dtype the gradient autograd makes (no hook, no bucket range) and the optimizer steps it, be it
a backward's or one the caller assigned. Reference: the same model, batches and AdamW in plain
PyTorch in the same process. Compared: every parameter after the steps, **bitwise** (one
process, one thread, the same arithmetic), that ``zero_grad`` frees the gradients, and that no
bucket buffer holds them.
"""

from __future__ import annotations

import pytest
import torch

from vescale.doptim import DistributedOptimizer, data_parallel, data_parallel_of
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _micro_batch(step: int, index: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + index))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, assign_gradient: bool) -> None:
    """Two accumulated micro-batches a step; with ``assign_gradient`` the last step's gradient is
    the caller's own tensor, not a backward's."""
    for step in range(STEPS):
        optimizer.zero_grad()
        if assign_gradient and step == STEPS - 1:
            for index, param in enumerate(model.parameters()):
                param.grad = torch.full_like(param, 0.1 * (index + 1))
        else:
            for index in range(2):
                (model(_micro_batch(step, index)).square().mean() / 2).backward()
        optimizer.step()


def _single_rank(zero_stage: int, assign_gradient: bool) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    reference = _model()
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), assign_gradient)
    model = _model()
    data_parallel(model, init_mesh(dp=1), zero_stage=zero_stage)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, optimizer, assign_gradient)
    optimizer.zero_grad()
    held = [fqn for fqn, param in model.named_parameters() if param.grad is not None]
    assert not held, f"zero_grad() left gradients of {held}"
    # No bucket buffer holds a second copy of the gradients (2.75 MiB on a pp4 Llama's first stage).
    buffers = [bucket.index for bucket in data_parallel_of(model).buckets if bucket.grad_buffer is not None]
    assert not buffers, f"buckets {buffers} allocated gradient buffers over one rank"
    expected = dict(reference.named_parameters())
    return {
        fqn: (param.detach() - expected[fqn].detach()).abs().max() for fqn, param in model.named_parameters()
    }


@pytest.mark.parametrize("assign_gradient", [False, True], ids=["backward", "assigned-gradient"])
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_one_rank_trains_bitwise_like_plain_pytorch(zero_stage: int, assign_gradient: bool):
    (differences,) = run_on_ranks(_single_rank, world_size=1, args=(zero_stage, assign_gradient))
    for fqn, difference in differences.items():
        assert difference == 0, f"ZeRO-{zero_stage} {fqn}: differs from plain PyTorch by {difference}"
