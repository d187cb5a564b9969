"""Measured pipeline bubble of PyTorch's 1F1B and interleaved 1F1B schedules on gloo ranks.

    .venv/bin/python tools/bench/pipeline_bubble.py                  # p = 2, 4; m = 4, 8, 16
    .venv/bin/python tools/bench/pipeline_bubble.py --forward-ms 10 --sizes 4 --microbatches 8

Compute is a stand-in that sleeps (forward ``--forward-ms``, backward twice that), so ranks
do not fight over the machine's cores and the idle time is the schedule's, not the CPU's.
Each rank times one schedule step (after a warm-up step, which also runs PyTorch's shape
inference) between barriers; ``busy`` is the time the rank spent inside the stand-in,
``idle = makespan - busy``. The table reports the worst rank's idle time over its busy time
against the textbook bubble ratio (p - 1) / (v m), and idle over makespan against
(p - 1) / (v m + p - 1), for v virtual stages per rank (v = 1 for 1F1B). The same schedule
run with zero-time compute gives the framework's own cost per step (Python, gloo send/recv,
sleep wake-up); ``bubble/busy`` subtracts it from the idle time, leaving the schedule's bubble.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from vescale.dtensor.testing import run_on_ranks


class _SleepingCompute(torch.autograd.Function):
    """Multiplies by a weight; sleeps instead of computing and records the time it slept."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, stage: nn.Module) -> torch.Tensor:
        ctx.stage = stage
        ctx.save_for_backward(hidden, weight)
        stage.sleep(stage.forward_s)
        return hidden * weight

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden, weight = ctx.saved_tensors
        ctx.stage.sleep(2 * ctx.stage.forward_s)
        return grad_output * weight, (grad_output * hidden).sum().reshape(1), None


class _SleepingStage(nn.Module):
    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.forward_s = forward_s
        self.busy_s = 0.0

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy_s += time.perf_counter() - start

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _SleepingCompute.apply(hidden, self.weight, self)


def _measure(num_microbatches: int, virtual_stages: int, forward_s: float) -> tuple[float, float]:
    size, rank = dist.get_world_size(), dist.get_rank()
    num_stages = size * virtual_stages
    # A rank's v stages together do the work of one stage of a v = 1 pipeline.
    modules = [_SleepingStage(forward_s / virtual_stages) for _ in range(virtual_stages)]
    stages = [
        PipelineStage(module, rank + index * size, num_stages, torch.device("cpu"))
        for index, module in enumerate(modules)
    ]
    loss_fn = lambda output, target: output.sum()  # noqa: E731
    if virtual_stages == 1:
        schedule = Schedule1F1B(stages[0], num_microbatches, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=loss_fn)
    batch, target = torch.ones(num_microbatches, 4), torch.zeros(num_microbatches, 4)
    for _step_index in range(2):
        for module in modules:
            module.busy_s = 0.0
        dist.barrier()
        start = time.perf_counter()
        _step(schedule, rank, batch, target)
        makespan = time.perf_counter() - start
        dist.barrier()
    return makespan, sum(module.busy_s for module in modules)


def _step(schedule, rank: int, batch: torch.Tensor, target: torch.Tensor) -> None:
    # Only the first stage takes the batch; every rank passes the target (the last stage uses it).
    if rank == 0:
        schedule.step(batch, target=target)
    else:
        schedule.step(target=target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--forward-ms", type=float, default=20.0)
    arguments = parser.parse_args()
    header = (
        "| schedule | p | v | m | makespan s | overhead s | idle/busy | bubble/busy | (p-1)/(vm) "
        "| idle/makespan | (p-1)/(vm+p-1) |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for size in arguments.sizes:
        for num_microbatches in arguments.microbatches:
            for name, virtual_stages in (("1f1b", 1), ("interleaved_1f1b", 2)):
                results = run_on_ranks(
                    _measure,
                    size,
                    args=(num_microbatches, virtual_stages, arguments.forward_ms / 1000),
                    timeout_s=300,
                )
                overhead = max(
                    result[0]
                    for result in run_on_ranks(
                        _measure, size, args=(num_microbatches, virtual_stages, 0.0), timeout_s=300
                    )
                )
                makespan = max(result[0] for result in results)
                idle = max(result[0] - result[1] for result in results)
                busy = min(result[1] for result in results)
                chunks = virtual_stages * num_microbatches
                print(
                    f"| {name} | {size} | {virtual_stages} | {num_microbatches} | {makespan:.3f} | "
                    f"{overhead:.3f} | {idle / busy:.3f} | {(idle - overhead) / busy:.3f} | "
                    f"{(size - 1) / chunks:.3f} | {idle / makespan:.3f} | "
                    f"{(size - 1) / (chunks + size - 1):.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
