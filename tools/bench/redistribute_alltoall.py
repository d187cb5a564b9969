"""Shard(0) -> Shard(1) on gloo: PyTorch's CPU path (all-gather + chunk) vs veScale's all-to-all.

Prints, per world size and shape, the collective issued, the bytes each rank sends and
receives (from vescale.dtensor.comm.CommCounter), the median time of 5 redistributions, and
whether the result equals the single-process chunk bitwise. Both paths run in the same rank
processes, one after the other.

    .venv/bin/python tools/bench/redistribute_alltoall.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from vescale.dtensor import _compat
from vescale.dtensor.comm import CommCounter
from vescale.dtensor.mesh import init_mesh
from vescale.dtensor.shard_alltoall import install_shard_alltoall
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool

REPEATS = 5


def measure(shape: tuple[int, int], torch_path: bool) -> tuple[str, int, int, float, bool]:
    mesh = init_mesh(tp=dist.get_world_size())
    full = torch.randn(shape)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    if torch_path:
        _compat.set_shard_to_new_shard_dim(_compat.original_shard_to_new_shard_dim())
    try:
        with CommCounter(mesh) as counter:
            moved = sharded.redistribute(mesh, [Shard(1)])
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            sharded.redistribute(mesh, [Shard(1)])
            times.append(time.perf_counter() - start)
    finally:
        install_shard_alltoall()
    bitwise = torch.equal(moved.to_local(), full.chunk(mesh.size(), 1)[mesh.get_local_rank()])
    call = counter.calls[0]
    return call.collective, call.bytes_sent, call.bytes_received, sorted(times)[REPEATS // 2] * 1e3, bitwise


def main() -> None:
    print("| ranks | shape | path | collective | bytes sent/rank | bytes recv/rank | median ms | bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    for world_size in (2, 4):
        for shape in [(1024, 1024), (1000, 1002)]:
            for torch_path in (True, False):
                collective, sent, received, ms, bitwise = run_on_ranks(
                    measure, world_size, args=(shape, torch_path)
                )[0]
                path = "torch (all-gather + chunk)" if torch_path else "vescale all-to-all"
                print(
                    f"| {world_size} | {shape[0]}x{shape[1]} | {path} | {collective} | {sent:,.0f} | "
                    f"{received:,.0f} | {ms:.2f} | {bitwise} |"
                )
    shutdown_rank_pool()


if __name__ == "__main__":
    main()
