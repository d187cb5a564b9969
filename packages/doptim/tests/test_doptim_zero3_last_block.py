"""ZeRO-3 keeps the last block gathered from its forward to its backward, as torchtitan does.

The last block's backward runs first, right after the forward: resharding it after its forward
would only gather it again. A step of a 3-block model on 2 ranks then all-gathers each block and
the root (its head) once in forward and the first two blocks again in backward: 6 all-gathers,
not 7. The numbers of a ZeRO-3 step are the other ZeRO-3 tests' (all of them run this way).
"""

from __future__ import annotations

import collections

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vescale.doptim import DistributedOptimizer, data_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

WIDTH = 8


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = block(inputs)
        return self.head(inputs)


class _CountAllGathers(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d.") and "allgather" in str(func):
            self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))


def _all_gathers_per_step() -> dict[str, int]:
    torch.manual_seed(0)
    model = data_parallel(_Net(), init_mesh(dp=2), zero_stage=3)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    inputs = torch.randn(4, WIDTH)
    model(inputs).sum().backward()  # FSDP2's lazy initialisation happens in the first step
    optimizer.step()
    optimizer.zero_grad()
    with _CountAllGathers() as counter:
        loss = model(inputs).sum()
        counter.phase = "backward"
        loss.backward()
    return dict(counter.counts)


def test_a_zero3_step_gathers_the_last_block_once():
    for counts in run_on_ranks(_all_gathers_per_step, 2):
        assert counts == {"forward": 4, "backward": 2}
