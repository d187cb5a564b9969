"""Measure this machine as ``world_size`` CPU ranks see it: matmul FLOP/s, fused attention's
efficiency by head dimension, memory bandwidth, the host cost of one op, gloo all-reduce
latency and bandwidth, the host time of AdamW's per-tensor loop (plain and DTensor
parameters), what a DTensor redistribution adds to the collective it runs, how long
a collective waits for its last member when the ranks come to it from computing, and the
backend's flat all-gather and reduce-scatter against a ring's time (gloo has no ring
reduce-scatter: 3-4x).

One rank measures the compute figures alone on a core (one intra-op thread, as veScale's CPU
ranks run) while the others wait. Then every rank runs a small training step at once, and the
slowest rank's time over rank 0's alone is the slowdown the ranks' contention for the cores,
caches and memory brings (about ``world_size / cores`` where the ranks outnumber the cores):
the FLOP/s and bandwidth are divided by it and the per-op host costs multiplied. (Timing each
figure on every rank at once instead caught the others' time slices at random: 8 ranks on 2
cores measured from 27 to 51 GFLOP/s a rank from run to run.)
The same step followed by a small all-reduce, against each of them alone, gives how long a
collective waits for its last member: ranks that outnumber the cores reach it a scheduler time
slice apart (2-4 ms at 4 ranks, 5-8 ms at 8 on 2 cores), a wait no collective timed alone shows.
Fused attention is fitted to ``e(d) = efficiency * d / (d + half_dim)`` of the fp32 matmul
peak from causal calls at head dimensions 16 and 64. A matmul is fitted to
``t = overhead + flops / peak`` from square matmuls of side 64 and 512; the all-reduce to
``t = 2 (n - 1) alpha + 2 (n - 1) / n * bytes / beta`` from 1 KiB and 8 MiB
tensors; the all-gather and reduce-scatter of 8 MiB are divided by half the all-reduce of the
same tensor timed beside them (a ring's). :func:`vescale.planner.hardware.calibrate_cpu`
turns the figures into a profile.

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
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vescale.doptim.reduction import all_gather_flat, reduce_scatter_flat

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["measure_cpu"]

_SMALL, _LARGE = 64, 512
_ATTENTION_SMALL, _ATTENTION_LARGE = 16, 64


def _seconds(work: Callable[[], object], repeats: int, together: bool = False, trials: int = 3) -> float:
    """Seconds per call: the mean over ``repeats`` calls, the fastest of ``trials`` for one rank
    alone (another process taking the core for a while only ever adds time) and the median with
    ``together``, where every rank starts each trial at once (a collective) and the spread is
    the ranks' own contention, part of what is measured."""
    work()
    means = []
    for _ in range(trials):
        if together:
            dist.barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            work()
        means.append((time.perf_counter() - started) / repeats)
    return statistics.median(means) if together else min(means)


def _matmul_fit(dtype: torch.dtype) -> tuple[float, float]:
    """``(peak FLOP/s, overhead s)`` of ``t = overhead + flops / peak``."""
    points = []
    for side, repeats in ((_SMALL, 200), (_LARGE, 6)):
        a, b = torch.randn(side, side, dtype=dtype), torch.randn(side, side, dtype=dtype)
        points.append((2.0 * side**3, _seconds(functools.partial(operator.matmul, a, b), repeats)))
    (small_flops, small_s), (large_flops, large_s) = points
    peak = (large_flops - small_flops) / max(large_s - small_s, 1e-9)
    return peak, max(small_s - small_flops / peak, 1e-7)


def _attention_fit(peak: float) -> tuple[float, float]:
    """``(efficiency, half_dim)`` of causal fused attention against ``peak``: ``e(d) = efficiency * d /
    (d + half_dim)`` through head dimensions 16 and 64 (FLOPs counted as the planner counts them)."""
    points = []
    for head_dim in (_ATTENTION_SMALL, _ATTENTION_LARGE):
        q, k, v = (torch.randn(2, 8, 128, head_dim) for _ in range(3))
        attention = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
        seconds = _seconds(attention, 20)
        flops = 4.0 * 2 * 8 * 128 * 128 * head_dim * 0.5
        points.append(flops / seconds / peak)
    small, large = points
    denominator = small / _ATTENTION_SMALL - large / _ATTENTION_LARGE
    half_dim = (large - small) / denominator if denominator > 0 and large > small else 1.0
    efficiency = large * (_ATTENTION_LARGE + half_dim) / _ATTENTION_LARGE
    return min(efficiency, 1.0), half_dim


def _all_reduce_seconds(numel: int, repeats: int) -> float:
    tensor = torch.ones(numel)
    return _seconds(lambda: dist.all_reduce(tensor), repeats, together=True)


def _zero_collective_factors(numel: int, trials: int = 5) -> tuple[float, float, float]:
    """The collectives ZeRO runs into and out of ``numel`` elements, each over a ring's time: half
    the all-reduce of the same tensor timed beside it (a ring all-reduce is a reduce-scatter and an
    all-gather); medians over ``trials``, so that the machine's drift between trials cancels.

    Returns the flat all-gather's, the flat reduce-scatter's and ZeRO-1/2's parameter publish's
    factor: the publish as ``vescale.doptim`` runs it on this backend, on
    :data:`~vescale.doptim.zero.BROADCAST_BACKENDS` every chunk owner broadcasting its ``1/n`` in
    place (all in flight, then waited), elsewhere the all-gather."""
    from vescale.doptim.zero import BROADCAST_BACKENDS

    world = dist.get_world_size()
    whole, chunk = torch.ones(numel - numel % world), torch.empty(numel // world)
    owned = whole.chunk(world)
    broadcasts = dist.get_backend() in BROADCAST_BACKENDS

    def publish() -> None:
        works = [dist.broadcast(piece, src=owner, async_op=True) for owner, piece in enumerate(owned)]
        for work in works:
            work.wait()

    gathers, scatters, publishes = [], [], []
    for _ in range(trials):
        ring = _seconds(lambda: dist.all_reduce(whole), 3, together=True, trials=1) / 2
        gathers.append(_seconds(lambda: all_gather_flat(whole, chunk), 3, together=True, trials=1) / ring)
        scatters.append(
            _seconds(lambda: reduce_scatter_flat(chunk, whole), 3, together=True, trials=1) / ring
        )
        publishes.append(_seconds(publish, 3, together=True, trials=1) / ring if broadcasts else gathers[-1])
    return statistics.median(gathers), statistics.median(scatters), statistics.median(publishes)


def _dtensor_op_seconds(leaf: torch.Tensor, mesh: DeviceMesh) -> float:
    """The same op on a DTensor (what tensor parallelism adds to every op), on a one-rank mesh."""
    from torch.distributed.tensor import DTensor, Replicate

    shared = DTensor.from_local(leaf.detach(), mesh, [Replicate()], run_check=False)
    shared.requires_grad_()

    def step() -> None:
        # An op on a DTensor returns a DTensor; torch's stubs type it as Tensor.
        product = cast(DTensor, shared.mul(2.0))
        product.to_local().sum().backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    return _seconds(step, 200) / 4


def _optimizer_tensor_seconds(mesh: DeviceMesh | None = None, tensors: int = 32) -> float:
    """Seconds of one ``torch.optim.AdamW`` step per parameter tensor, on ``tensors`` tiny ones
    (DTensors on ``mesh`` where one is given): the per-tensor loop's host time, under
    ``no_grad`` as the step runs it, with the defaults a user's optimizer has."""
    from torch.distributed.tensor import DTensor, Replicate

    def parameter() -> torch.nn.Parameter:
        value = torch.ones(4)
        if mesh is not None:
            value = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        parameter = torch.nn.Parameter(value)
        parameter.grad = torch.full_like(value, 0.5)
        return parameter

    optimizer = torch.optim.AdamW([parameter() for _ in range(tensors)], lr=1e-3)
    return _seconds(optimizer.step, 20) / tensors


def _redistribute_overhead_seconds() -> float:
    """What a DTensor redistribution (``Shard(0) -> Replicate``, as tensor parallelism runs) costs
    beyond the same all-gather called directly: its planning, copies and autograd wrapping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    local = torch.ones(64, 32)
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    gathered = torch.empty(world * 64, 32)
    direct = _seconds(lambda: all_gather_flat(gathered, local), 30, together=True)
    redistributed = _seconds(lambda: sharded.redistribute(mesh, [Replicate()]).to_local(), 30, together=True)
    return max(redistributed - direct, 0.0)


def _training_work() -> Callable[[], None]:
    """A small training step (an MLP block's forward and backward, ~10 ms on one core)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(
        torch.nn.LayerNorm(256), torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)
    )
    inputs = torch.randn(128, 256)
    return lambda: block(inputs).sum().backward()


def _collective_wait_seconds(work: Callable[[], None], trials: int = 15) -> float:
    """How long a small all-reduce of every rank waits for its last member when each rank comes
    to it from ``work`` (the ranks sharing cores arrive a time slice apart): a loop of work and
    all-reduce, less the work alone and the all-reduce alone, all timed with every rank at once;
    the median over ``trials`` (each difference is of noisy at-once timings)."""
    tensor = torch.ones(256)

    def communicate() -> None:
        dist.all_reduce(tensor)

    def work_then_communicate() -> None:
        work()
        communicate()

    waits = []
    for _ in range(trials):
        alone = _seconds(work, 10, together=True, trials=1) + _seconds(
            communicate, 10, together=True, trials=1
        )
        waits.append(_seconds(work_then_communicate, 10, together=True, trials=1) - alone)
    return max(statistics.median(waits), 0.0)


def _slowdown_at_once(work: Callable[[], None], timer: bool, rounds: int = 5) -> float:
    """How much longer the slowest rank takes ``work`` when every rank runs it at once than the
    ``timer`` rank (rank 0) alone, the others waiting in a barrier: the share of a core each rank
    really gets, cache and scheduling included (known on the timer rank; 1.0 on the others,
    whose figures :func:`measure_cpu` does not read).

    Alone and at once alternate for ``rounds`` rounds. Alone keeps its fastest: a process
    outside the ranks that takes the timer's core for a while (a test beside this one, a build)
    only adds time, and a median of back-to-back timings could take all of its samples from such
    a window (two ranks on one core measured 1.12 there, against 2.2 quiet). At once keeps the
    median, as :func:`_seconds` does with ``together``: its spread is the ranks' own contention,
    which a training step meets every step (the fastest round read 13-22% under the median at 4
    and 8 ranks on 2 cores, and the grid's steps ran that much slower than predicted)."""
    alone, at_once = float("inf"), []
    for _ in range(rounds):
        if timer:
            alone = min(alone, _seconds(work, 15, trials=1))
        dist.barrier()
        slowest = torch.tensor([_seconds(work, 15, together=True, trials=1)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        at_once.append(float(slowest))
    return statistics.median(at_once) / alone if timer else 1.0


def _one_core_figures(mesh: DeviceMesh) -> dict[str, float]:
    """Compute figures of one rank running alone on a core."""
    figures: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        figures[f"{name}_flops"], figures[f"{name}_matmul_overhead_s"] = _matmul_fit(dtype)
    figures["attention_efficiency"], figures["attention_half_dim"] = _attention_fit(figures["fp32_flops"])
    source, target = torch.ones(8 * 2**20), torch.empty(8 * 2**20)
    figures["memory_bandwidth"] = 2 * source.nbytes / _seconds(lambda: target.copy_(source), 10)
    # One eager op as training runs it: autograd records it and backward runs its gradient.
    leaf = torch.ones(4, requires_grad=True)
    # torch leaves Tensor.backward unannotated.
    figures["op_overhead_s"] = _seconds(lambda: leaf.mul(2.0).sum().backward(), 500) / 4  # type: ignore[no-untyped-call]
    figures["dtensor_op_overhead_s"] = _dtensor_op_seconds(leaf, mesh)
    figures["optimizer_tensor_s"] = _optimizer_tensor_seconds()
    figures["dtensor_optimizer_tensor_s"] = _optimizer_tensor_seconds(mesh)
    return figures


def _measure_on_rank() -> dict[str, float]:
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    # A one-rank mesh for rank 0's DTensor measurement (every rank takes part in creating it).
    group = dist.new_group([0])
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",)) if dist.get_rank() == 0 else None
    # Rank 0 measures the compute figures alone (the others wait in the barrier, off the cores):
    # ranks measuring at once would each catch other ranks' time slices at random.
    figures = _one_core_figures(mesh) if mesh is not None else {}
    work = _training_work()
    dist.barrier()
    # One rank has no other rank to share its core with: timing it twice would only add noise.
    figures["slowdown_at_once"] = _slowdown_at_once(work, timer=mesh is not None) if world > 1 else 1.0
    if world > 1:
        small_s = _all_reduce_seconds(256, 50)
        large_numel = 2 * 2**20
        large_s = _all_reduce_seconds(large_numel, 5)
        steps = 2 * (world - 1)
        alpha = small_s / steps
        figures["collective_latency_s"] = alpha
        figures["collective_bandwidth"] = steps / world * large_numel * 4 / max(large_s - steps * alpha, 1e-9)
        figures["redistribute_overhead_s"] = _redistribute_overhead_seconds()
        figures["collective_wait_s"] = _collective_wait_seconds(work)
        (
            figures["all_gather_factor"],
            figures["reduce_scatter_factor"],
            figures["zero_publish_factor"],
        ) = _zero_collective_factors(large_numel)
    else:
        figures["collective_latency_s"], figures["collective_bandwidth"] = 1e-5, 1e10
        figures["redistribute_overhead_s"] = figures["collective_wait_s"] = 0.0
        figures["all_gather_factor"] = figures["reduce_scatter_factor"] = figures["zero_publish_factor"] = 1.0
    return figures


def measure_cpu(world_size: int = 2) -> dict[str, float]:
    """The figures of the module docstring (plus ``memory_bytes`` and ``cores``): the collective
    ones the median over the ranks, the compute ones one core's scaled by the share of a core
    each of ``world_size`` ranks gets (``1 / slowdown_at_once``: about ``cores / world_size``
    when the ranks outnumber the cores); each compute figure also unscaled, as ``one_core_<name>``.

    Example::

        measure_cpu(2)["op_overhead_s"]   # a few microseconds
    """
    # The rank harness is imported only when measuring: importing the planner starts no rank pool.
    from vescale.dtensor.testing import run_on_ranks

    per_rank = run_on_ranks(_measure_on_rank, world_size, timeout_s=600)
    figures = dict(per_rank[0])
    for key in (
        "collective_latency_s",
        "collective_bandwidth",
        "redistribute_overhead_s",
        "collective_wait_s",
        "all_gather_factor",
        "reduce_scatter_factor",
        "zero_publish_factor",
    ):
        figures[key] = statistics.median(rank[key] for rank in per_rank)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = 1.0 / max(1.0, figures["slowdown_at_once"])
    for key in ("fp32_flops", "bf16_flops", "memory_bandwidth"):
        figures[f"one_core_{key}"] = figures[key]
        figures[key] *= share
    for key in (
        "fp32_matmul_overhead_s",
        "bf16_matmul_overhead_s",
        "op_overhead_s",
        "dtensor_op_overhead_s",
        "optimizer_tensor_s",
        "dtensor_optimizer_tensor_s",
    ):
        figures[f"one_core_{key}"] = figures[key]
        figures[key] /= share
    figures["cores"] = float(cores)
    figures["memory_bytes"] = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return figures
