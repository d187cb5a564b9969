"""Measure this machine as ``world_size`` CPU ranks see it: matmul FLOP/s, memory bandwidth, the
host cost of one op, and gloo all-reduce latency and bandwidth.

Every rank measures at the same time (one intra-op thread each, as veScale's CPU ranks run),
so the figures include the ranks' contention for the cores, caches and memory. A matmul is
fitted to ``t = overhead + flops / peak`` from square matmuls of side 64 and 512; the
all-reduce to ``t = 2 (n - 1) alpha + 2 (n - 1) / n * bytes / beta`` from 1 KiB and 8 MiB
tensors. :func:`vescale.planner.hardware.calibrate_cpu` turns the figures into a profile.

Example::

    figures = measure_cpu(world_size=4)
    figures["fp32_flops"], figures["collective_bandwidth"]
"""

from __future__ import annotations

import functools
import operator
import os
import statistics
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

__all__ = ["measure_cpu"]

_SMALL, _LARGE = 64, 512


def _seconds(work: Callable[[], object], repeats: int) -> float:
    work()
    if dist.is_initialized():
        dist.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - started) / repeats


def _matmul_fit(dtype: torch.dtype) -> tuple[float, float]:
    """``(peak FLOP/s, overhead s)`` of ``t = overhead + flops / peak``."""
    points = []
    for side, repeats in ((_SMALL, 200), (_LARGE, 6)):
        a, b = torch.randn(side, side, dtype=dtype), torch.randn(side, side, dtype=dtype)
        points.append((2.0 * side**3, _seconds(functools.partial(operator.matmul, a, b), repeats)))
    (small_flops, small_s), (large_flops, large_s) = points
    peak = (large_flops - small_flops) / max(large_s - small_s, 1e-9)
    return peak, max(small_s - small_flops / peak, 1e-7)


def _all_reduce_seconds(numel: int, repeats: int) -> float:
    tensor = torch.ones(numel)
    return _seconds(lambda: dist.all_reduce(tensor), repeats)


def _dtensor_op_seconds(leaf: torch.Tensor) -> float:
    """The same op on a DTensor over all ranks (what tensor parallelism adds to every op)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shared = distribute_tensor(leaf.detach(), mesh, [Replicate()])
    shared.requires_grad_()

    def step() -> None:
        # An op on a DTensor returns a DTensor; torch's stubs type it as Tensor.
        product = cast(DTensor, shared.mul(2.0))
        product.to_local().sum().backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    return _seconds(step, 200) / 4


def _measure_on_rank() -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        figures[f"{name}_flops"], figures[f"{name}_matmul_overhead_s"] = _matmul_fit(dtype)
    source, target = torch.ones(8 * 2**20), torch.empty(8 * 2**20)
    figures["memory_bandwidth"] = 2 * source.nbytes / _seconds(lambda: target.copy_(source), 10)
    # One eager op as training runs it: autograd records it and backward runs its gradient.
    leaf = torch.ones(4, requires_grad=True)
    # torch leaves Tensor.backward unannotated.
    figures["op_overhead_s"] = _seconds(lambda: leaf.mul(2.0).sum().backward(), 500) / 4  # type: ignore[no-untyped-call]
    figures["dtensor_op_overhead_s"] = _dtensor_op_seconds(leaf)
    world = dist.get_world_size()
    if world > 1:
        small_s = _all_reduce_seconds(256, 50)
        large_numel = 2 * 2**20
        large_s = _all_reduce_seconds(large_numel, 5)
        steps = 2 * (world - 1)
        alpha = small_s / steps
        figures["collective_latency_s"] = alpha
        figures["collective_bandwidth"] = steps / world * large_numel * 4 / max(large_s - steps * alpha, 1e-9)
    else:
        figures["collective_latency_s"], figures["collective_bandwidth"] = 1e-5, 1e10
    return figures


def measure_cpu(world_size: int = 2) -> dict[str, float]:
    """The figures of the module docstring, each the median over the ranks (plus ``memory_bytes``).

    Example::

        measure_cpu(2)["op_overhead_s"]   # a few microseconds
    """
    # The rank harness is imported only when measuring: importing the planner starts no rank pool.
    from vescale.dtensor.testing import run_on_ranks

    per_rank = run_on_ranks(_measure_on_rank, world_size, timeout_s=600)
    figures = {key: statistics.median(rank[key] for rank in per_rank) for key in per_rank[0]}
    figures["memory_bytes"] = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return figures
