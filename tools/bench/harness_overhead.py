"""Per-test overhead of veScale's multi-process harness vs spawning ranks per test.

    .venv/bin/python tools/bench/harness_overhead.py            # world sizes 2, 4, 8
    .venv/bin/python tools/bench/harness_overhead.py --repeats 50 --world-sizes 4

Each "test" is one all-reduce of a 4-element tensor on every rank. The PyTorch-native
baseline is what torch's own MultiProcessTestCase-style tests do: ``torch.multiprocessing.spawn``
a fresh set of ranks per test, each importing torch and building a gloo group over a
``file://`` store. The harness keeps its rank processes warm across tests (a cold start is
reported separately) and builds a new process group per test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing

from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool


def all_reduce_probe() -> float:
    value = torch.ones(4) * dist.get_rank()
    dist.all_reduce(value)
    return value[0].item()


def spawned_all_reduce_probe(rank: int, world_size: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    value = torch.ones(4) * rank
    dist.all_reduce(value)
    dist.destroy_process_group()


def time_spawn_per_test(world_size: int, repeats: int) -> list[float]:
    seconds = []
    with tempfile.TemporaryDirectory() as directory:
        for repeat in range(repeats):
            store_path = os.path.join(directory, f"store-{repeat}")
            started = time.perf_counter()
            torch.multiprocessing.spawn(
                spawned_all_reduce_probe, args=(world_size, store_path), nprocs=world_size
            )
            seconds.append(time.perf_counter() - started)
    return seconds


def time_harness(world_size: int, repeats: int) -> tuple[float, list[float]]:
    shutdown_rank_pool()
    expected = float(sum(range(world_size)))
    started = time.perf_counter()
    assert run_on_ranks(all_reduce_probe, world_size) == [expected] * world_size
    cold = time.perf_counter() - started
    warm = []
    for _ in range(repeats):
        started = time.perf_counter()
        assert run_on_ranks(all_reduce_probe, world_size) == [expected] * world_size
        warm.append(time.perf_counter() - started)
    return cold, warm


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=30, help="warm harness runs per world size")
    parser.add_argument("--spawn-repeats", type=int, default=3, help="spawn-per-test runs per world size")
    arguments = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo on CPU; seconds per test\n")
    header = (
        f"{'ranks':>5} | {'harness warm mean':>17} | {'warm p95':>8} | {'harness cold start':>18} | "
        f"{'spawn per test (native)':>23} | {'speed-up':>8}"
    )
    print(header)
    print("-" * len(header))
    for world_size in arguments.world_sizes:
        cold, warm = time_harness(world_size, arguments.repeats)
        spawned = time_spawn_per_test(world_size, arguments.spawn_repeats)
        warm_mean, spawn_mean = statistics.mean(warm), statistics.mean(spawned)
        p95 = sorted(warm)[max(0, int(0.95 * len(warm)) - 1)]
        print(
            f"{world_size:>5} | {warm_mean:>17.3f} | {p95:>8.3f} | {cold:>18.2f} | "
            f"{spawn_mean:>23.2f} | {spawn_mean / warm_mean:>7.0f}x"
        )
    shutdown_rank_pool()


if __name__ == "__main__":
    main()
