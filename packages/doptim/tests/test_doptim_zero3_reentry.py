"""ZeRO-3 on a model whose backward recomputes a block's inner modules, not the block (issue #18).

Reformer's reversible layers run forward under ``no_grad`` inside an autograd Function and, in
its backward, call ``layer.attention`` and ``layer.feed_forward`` directly to recompute what they
did not keep. FSDP2 gathers a unit's parameters only around the unit's own forward and backward,
so those calls met the dp shards: "got mixed torch.Tensor and DTensor" (a shape error on a
dp x tp mesh). ``data_parallel(zero_stage=3)`` now makes such a call gather its unit first, and
the gradients it produces are reduce-scattered at the end of backward.

Model: an embedding, two blocks behind a recomputing autograd Function (as Reformer's), a head;
every block is its own FSDP unit. Reference: the same model in one process (``train_reference``).
Compared: every first-step gradient read back from one SGD step, and 3 AdamW losses, within
1e-5 relative (float32: the two halves' gradients summed over ranks against the whole batch's in
one process). Without the fix the first backward raises the error above.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vescale.doptim import DistributedOptimizer, data_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.mlp import mlp_batches, mse_loss
from vescale.dtensor.testing.numerics import assert_close_by_fqn
from vescale.dtensor.testing.readback import sgd_gradients_and_mean_losses
from vescale.dtensor.testing.reference import assert_matches_reference, train_reference

RTOL = 1e-5
GLOBAL_BATCH, WIDTH, STEPS, SGD_LR = 8, 16, 3, 1e3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mix(hidden).tanh()


class _RecomputedBlocks(torch.autograd.Function):
    """Runs the blocks keeping only their input; backward recomputes each block from its inner module."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
        ctx.blocks = blocks
        ctx.save_for_backward(hidden)
        with torch.no_grad():
            for block in blocks:
                hidden = block(hidden)
        return hidden

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (hidden,) = ctx.saved_tensors
        with torch.enable_grad():
            start = hidden.detach().requires_grad_()
            output = start
            for block in ctx.blocks:
                output = output + block.mix(output).tanh()
            torch.autograd.backward(output, grad)
        return start.grad, None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(_RecomputedBlocks.apply(self.embed(inputs), self.blocks))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mlp_batches(steps, GLOBAL_BATCH, inputs=WIDTH, outputs=1)


def _local_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = GLOBAL_BATCH // dist.get_world_size()
    part = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    return [(inputs[part], targets[part]) for inputs, targets in _batches(STEPS)]


def _zero3(optimizer_fn) -> tuple[nn.Module, DistributedOptimizer]:
    torch.manual_seed(0)
    model = data_parallel(_Net(), init_mesh(dp=dist.get_world_size()), zero_stage=3)
    return model, DistributedOptimizer(optimizer_fn(model))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _run_zero3() -> dict:
    torch.set_num_threads(1)
    return sgd_gradients_and_mean_losses(_zero3, _local_batches(), mse_loss, _adamw, SGD_LR)


def test_zero3_block_recomputed_from_its_inner_modules_trains_like_one_process():
    reference = train_reference(_Net, _batches(STEPS), _adamw, loss_fn=mse_loss)
    for run in run_on_ranks(_run_zero3, 2, timeout_s=120):
        assert_matches_reference(reference, [run["losses"]], loss_rtol=RTOL, label="zero3 reentry")
        worst = assert_close_by_fqn(
            run["gradients"], reference.first_gradients(run["gradients"]), RTOL, "first-step gradient"
        )
        print(f"worst first-step gradient error {worst:.1e}")
