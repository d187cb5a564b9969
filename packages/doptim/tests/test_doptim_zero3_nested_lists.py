"""ZeRO-3 on blocks that hold lists of modules themselves (issue #18).

LongCat-Flash's decoder layers each hold a ``ModuleList`` of two attentions and one of two
MLPs. ``data_parallel(zero_stage=3)`` wraps each block of the outermost list with FSDP2; a
list inside a block belongs to its block's unit (wrapping it again handed FSDP2 parameters
sharded over dp already: "Expected Replicate() on DP shard dim 'dp' but got S(0)").

Reference: ``train_reference`` on the same model, seed and global batch. Compared: 3 AdamW
losses (1e-5) and every first-step gradient read back from one SGD step (1e-5; float32
summation order over 2 ranks measures ~1e-7).
"""

from __future__ import annotations

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
        self.branches = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(2))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for branch, norm in zip(self.branches, self.norms, strict=True):
            hidden = hidden + branch(norm(hidden)).tanh()
        return hidden


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = block(inputs)
        return self.head(inputs)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return mlp_batches(steps, GLOBAL_BATCH, inputs=WIDTH, outputs=1)


def _local(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = GLOBAL_BATCH // dist.get_world_size()
    part = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    return batch[0][part], batch[1][part]


def _zero3(optimizer_fn) -> tuple[nn.Module, DistributedOptimizer]:
    torch.manual_seed(0)
    model = _Net()
    data_parallel(model, init_mesh(dp=dist.get_world_size()), zero_stage=3)
    return model, DistributedOptimizer(optimizer_fn(model))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _run_zero3() -> dict:
    local_batches = [_local(batch) for batch in _batches(STEPS)]
    return sgd_gradients_and_mean_losses(_zero3, local_batches, mse_loss, _adamw, SGD_LR)


def test_zero3_wraps_blocks_whose_modules_hold_lists_and_trains_like_one_process():
    reference = train_reference(_Net, _batches(STEPS), _adamw, loss_fn=mse_loss)
    for run in run_on_ranks(_run_zero3, 2, timeout_s=120):
        assert_matches_reference(reference, [run["losses"]], loss_rtol=RTOL, label="zero3 nested lists")
        worst = assert_close_by_fqn(run["gradients"], reference.gradients[0], RTOL, "first-step gradient")
        print(f"worst first-step gradient error {worst:.1e}")
