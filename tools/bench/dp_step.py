"""Data-parallel training step: veScale's DDP/ZeRO 0-3 vs PyTorch DDP and FSDP2, memory and time.

    .venv/bin/python tools/bench/dp_step.py                      # ~100M parameters, dp=2
    .venv/bin/python tools/bench/dp_step.py --dp 4 --steps 5     # dp=4
    .venv/bin/python tools/bench/dp_step.py --width 1024          # a quick run (~6M parameters)

The model is a stack of ``--layers`` wide ``Linear(width, width)`` + GELU blocks in an
``nn.ModuleList`` (FSDP2's units; ``--width 4096 --layers 6`` is 100.7M parameters), trained
with AdamW on ``--rows`` rows per rank (loss: mean square of the output). Every variant runs
in its own run on the same ``--dp`` gloo ranks, one thread per rank, from the same seed:

* PyTorch DDP (``DistributedDataParallel`` with ``gradient_as_bucket_view=True``,
  ``static_graph=True`` and our ``--bucket-mb`` buckets) vs ours at ZeRO-0;
* ``torch.distributed.optim.ZeroRedundancyOptimizer`` over that DDP vs ours at ZeRO-1;
* PyTorch FSDP2 with ``reshard_after_forward=False`` everywhere (ZeRO-2: gradients and state
  sharded, parameters kept whole) vs ours at ZeRO-2 with buckets of ``--zero2-bucket-mb``
  (default: one block's weight, so that a bucket is no coarser than the FSDP2 unit it is
  measured against; each block's weight is then reduced on its own, in place). ZeRO-2 holds
  about two buckets of full-size gradients beyond its 1/dp: the default 25 MB bucket is 1/30 of
  one block's gradients in a 7B Llama, but here it would be the whole 24 MiB model, and the
  row would measure a model smaller than one bucket (ours 50 MiB against FSDP2's 28);
* PyTorch FSDP2 with torchtitan's settings (``fully_shard`` per block, resharding after forward
  except the last block, and the root) vs ours at ZeRO-3, which is FSDP2 ``fully_shard`` per
  element of each ``nn.ModuleList`` and the root, driven by ``vescale.doptim``;
* deterministic mode at ZeRO-0 to 3 (vs the default mode; reported, not checked).

Step time is fwd + bwd + optimizer step + ``zero_grad``, each step bracketed by barriers:
the slowest rank's time, median of ``--steps`` steps after one warm-up step. ``--repeats R``
runs the whole list of variants R times, interleaved (variant A, B, ..., A, B, ...), so that
load from other processes on the machine hits every variant alike; the table gives the median
over the repeats and the spread (min-max) of the repeats' step times, and each time ratio is
the median of the per-repeat ratios with its own min-max.

Memory per rank, as tensor bytes this rank holds (unique storages): parameters (local shards;
fp32 masters that are views count once), gradients right after backward (``.grad`` of
parameters and masters, and our bucket buffers and ZeRO-2 chunks; PyTorch DDP's own buckets are
internal and not counted, its peak below includes them), optimizer state after the step. Peak
growth is over what was live once the plain model is built (and each variant's one-time set-up
done, see :func:`_warm_up`), through wrapping, the warm-up step and the steps: it counts the
wrappers' buffers (allocated up front or lazily), optimizer state, gradients, activations,
communication buffers and temporaries (and less for FSDP2/ZeRO-3, which free the unsharded
parameters): of malloc's bytes in use (``PeakHeapInUse``), which the checked ratio uses, and of
the resident set (``PeakResident``), shown beside it. The worst rank is reported. A second
table divides each of ours by the single-device size (fp32 parameters, gradients, AdamW's two
moments) and gives the excess over the ZeRO target (1/dp of the state from stage 1, of the
gradients from stage 2, of the parameters at stage 3) in buckets (``--bucket-mb``; ZeRO-2's
``--zero2-bucket-mb``)."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from vescale.doptim import DistributedOptimizer, data_parallel, data_parallel_of
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.memory import PeakHeapInUse, PeakResident

VARIANTS = (
    "torch DDP",
    "ours ZeRO-0",
    "ours ZeRO-0 deterministic",
    "torch ZeroRedundancyOptimizer",
    "ours ZeRO-1",
    "ours ZeRO-1 deterministic",
    "torch FSDP2 no reshard",
    "ours ZeRO-2",
    "ours ZeRO-2 deterministic",
    "torch FSDP2",
    "ours ZeRO-3",
    "ours ZeRO-3 deterministic",
)
# (ours, native baseline, time goal or None): the rows run_all.py checks.
PAIRS = (
    ("ours ZeRO-0", "torch DDP", 1.0),
    ("ours ZeRO-1", "torch ZeroRedundancyOptimizer", 1.0),
    ("ours ZeRO-2", "torch FSDP2 no reshard", 1.0),
    ("ours ZeRO-3", "torch FSDP2", 1.0),
    *((f"ours ZeRO-{stage} deterministic", f"ours ZeRO-{stage}", None) for stage in range(4)),
)
MiB = 2**20


class WideMLP(nn.Module):
    """``layers`` blocks of ``Linear(width, width)`` + GELU."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = block(inputs)
        return inputs


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _unique_bytes(tensors: list[torch.Tensor | None]) -> int:
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = _local(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _wrap(variant: str, model: nn.Module, bucket_size_mb: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_mesh(dp=dist.get_world_size())
    if variant in ("torch DDP", "torch ZeroRedundancyOptimizer"):
        # What a PyTorch engineer would write: gradients as views of the buckets (no copy, no
        # second gradient copy in memory), a static graph (the same parameters every step), the
        # same bucket size as ours.
        wrapped = nn.parallel.DistributedDataParallel(
            model,
            process_group=mesh.get_group("dp"),
            bucket_cap_mb=bucket_size_mb,
            gradient_as_bucket_view=True,
            static_graph=True,
        )
        if variant == "torch DDP":
            return wrapped, torch.optim.AdamW(model.parameters(), lr=1e-4)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, process_group=mesh.get_group("dp"), lr=1e-4
        )
        return wrapped, optimizer
    if variant.startswith("torch FSDP2"):
        from torch.distributed.fsdp import fully_shard

        # torchtitan's settings for ZeRO-3: every block but the last reshards after forward (the
        # last one's parameters are needed again at once by backward), the root does not; ZeRO-2
        # (gradients and state sharded, parameters kept whole) never reshards.
        reshard = variant == "torch FSDP2"
        for index, block in enumerate(model.blocks):
            fully_shard(
                block, mesh=mesh["dp"], reshard_after_forward=reshard and index < len(model.blocks) - 1
            )
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    zero_stage = int(variant.split("ZeRO-")[1][0])
    options = {} if zero_stage == 3 else {"bucket_size_mb": bucket_size_mb}
    if variant.endswith("deterministic"):
        options["deterministic"] = True
    data_parallel(model, mesh, zero_stage=zero_stage, **options)
    return model, DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))


def _gradient_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    tensors = [param.grad for param in model.parameters()]
    tensors += [param.grad for group in optimizer.param_groups for param in group["params"]]
    ddp = data_parallel_of(model)
    for bucket in getattr(ddp, "buckets", []):
        tensors += [bucket.grad_buffer, bucket.grad_chunk]
    return tensors


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local shard
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim()
    ]


def _warm_up(variant: str, bucket_size_mb: float) -> None:
    """One step of ``variant`` on a two-block model of width 64, before the memory baseline: each
    side's one-time set-up (the modules it imports on first use, torch._dynamo's ~200 among
    them for FSDP2 and for ours, 8.7 MiB of heap; gloo's first buffers) is then not counted as
    the measured model's memory, on either side."""
    model, optimizer = _wrap(variant, WideMLP(64, 2), bucket_size_mb)
    model(torch.ones(2, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def benchmark_rank(
    variant: str, width: int, layers: int, rows: int, steps: int, bucket_size_mb: float
) -> dict:
    _warm_up(variant, bucket_size_mb)
    torch.manual_seed(0)
    model = WideMLP(width, layers)
    inputs = torch.randn(rows, width, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    times, grad_bytes = [], 0
    # From before wrapping: buffers a wrapper allocates up front (DDP's and ZeRO-0/1's gradient
    # buckets) count like those allocated during the steps (ZeRO-2's, lazily).
    with PeakResident() as peak, PeakHeapInUse() as heap:
        wrapped, optimizer = _wrap(variant, model, bucket_size_mb)
        masters = [param for group in optimizer.param_groups for param in group["params"]]
        param_bytes = _unique_bytes([*model.parameters(), *masters])
        for step in range(1 + steps):
            dist.barrier()
            start = time.perf_counter()
            wrapped(inputs).square().mean().backward()
            if step == 0:
                if isinstance(optimizer, DistributedOptimizer):
                    optimizer.prepare_grads()  # the averaged gradients, where the step reads them
                grad_bytes = _unique_bytes(_gradient_tensors(model, optimizer))
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - start)
    return {
        "times": times[1:],
        "params": param_bytes,
        "grads": grad_bytes,
        "state": _unique_bytes(_state_tensors(optimizer)),
        "peak": peak.growth,
        "heap": heap.growth,
    }


def _slowest(results: list[dict]) -> float:
    per_step = [max(steps) for steps in zip(*(result["times"] for result in results), strict=True)]
    return statistics.median(per_step)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _print_time_and_memory(measured: dict[str, dict], repeats: int) -> None:
    print(
        f"| variant | step time (s), median of {repeats} (min-max) | params (MiB) | grads (MiB) | "
        "optimizer state (MiB) | peak heap-in-use growth (MiB) | peak resident growth (MiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant, row in measured.items():
        print(
            f"| {variant} | {_spread(row['times'])} | {row['params'] / MiB:.0f} | {row['grads'] / MiB:.0f} | "
            f"{row['state'] / MiB:.0f} | {row['heap'] / MiB:.0f} | {row['peak'] / MiB:.0f} |"
        )
    pairs = [(ours, other) for ours, other, _ in PAIRS]
    print(
        "\n| ours | against | time ratio (goal <= 1.00), median of per-repeat ratios (min-max) | "
        "peak heap-in-use ratio (goal <= 1.0) | peak resident ratio |"
    )
    print("|---|---|---:|---:|---:|")
    for ours, other in pairs:
        if ours in measured and other in measured:
            pairs_of_times = zip(measured[ours]["times"], measured[other]["times"], strict=True)
            ratios = [mine / theirs for mine, theirs in pairs_of_times]
            heap_ratio = measured[ours]["heap"] / max(measured[other]["heap"], 1)
            resident_ratio = measured[ours]["peak"] / max(measured[other]["peak"], 1)
            print(f"| {ours} | {other} | {_spread(ratios)} | {heap_ratio:.3f} | {resident_ratio:.3f} |")


def _print_zero_targets(
    measured: dict[str, dict], numel: int, dp: int, bucket_mb: float, zero2_bucket_mb: float
) -> None:
    single = {"params": numel * 4, "grads": numel * 4, "state": 2 * numel * 4}
    print(
        f"\n| ours | params / single | grads / single | state / single | target (1/dp = {1 / dp:.3f}) | "
        f"largest excess over target, in buckets ({bucket_mb:g} MB; ZeRO-2 {zero2_bucket_mb:g} MB) |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for variant, row in measured.items():
        if not variant.startswith("ours"):
            continue
        zero_stage = int(variant.split("ZeRO-")[1][0])
        sharded = {"state": zero_stage >= 1, "grads": zero_stage >= 2, "params": zero_stage == 3}
        excess = max(
            row[key] - single[key] / dp if sharded[key] else row[key] - single[key] for key in single
        )
        targets = ", ".join(key for key in single if sharded[key]) or "none"
        bucket_bytes = (zero2_bucket_mb if zero_stage == 2 else bucket_mb) * 2**20
        print(
            f"| {variant} | {row['params'] / single['params']:.3f} | {row['grads'] / single['grads']:.3f} | "
            f"{row['state'] / single['state']:.3f} | 1/dp: {targets} | {excess / bucket_bytes:.2f} |"
        )


def main() -> None:
    from bench_rows import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8, help="rows per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs (blocks) of every variant")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument(
        "--zero2-bucket-mb", type=float, help="ZeRO-2's buckets (default: one block's weight, width^2 floats)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", help="write the checked rows here (for run_all.py)")
    arguments = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    numel = arguments.layers * (arguments.width**2 + arguments.width)
    zero2_bucket_mb = arguments.zero2_bucket_mb or arguments.width**2 * 4 / MiB
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, dp={arguments.dp}; "
        f"{numel / 1e6:.1f}M parameters ({numel * 4 / MiB:.0f} MiB fp32), {arguments.rows} rows per rank; "
        f"median of {arguments.steps} steps after 1 warm-up, slowest rank per step; "
        f"{arguments.repeats} interleaved repeat(s)\n"
    )
    measured: dict[str, dict] = {}
    for _ in range(arguments.repeats):
        for variant in arguments.variants:
            results = run_on_ranks(
                benchmark_rank,
                arguments.dp,
                (
                    variant,
                    arguments.width,
                    arguments.layers,
                    arguments.rows,
                    arguments.steps,
                    zero2_bucket_mb if "ZeRO-2" in variant else arguments.bucket_mb,
                ),
                timeout_s=600,
            )
            # Fresh rank processes for every run: the peak is then this variant's alone, and the heap
            # a 100M-parameter run leaves behind does not pile up across variants.
            shutdown_rank_pool()
            row = measured.setdefault(
                variant, {"times": [], "params": 0, "grads": 0, "state": 0, "peak": 0, "heap": 0}
            )
            row["times"].append(_slowest(results))
            for key in ("params", "grads", "state", "peak", "heap"):
                row[key] = max(row[key], *(result[key] for result in results))
    _print_time_and_memory(measured, arguments.repeats)
    _print_zero_targets(measured, numel, arguments.dp, arguments.bucket_mb, zero2_bucket_mb)
    from bench_rows import bench_row, write_rows

    rows = [
        bench_row(
            f"dp_step dp{arguments.dp}",
            f"{ours} vs {other}",
            measured[ours]["times"],
            measured[other]["times"],
            measured[ours]["heap"],
            measured[other]["heap"],
            time_goal=goal,
            memory_goal=1.0 if goal else None,
            resident_peaks=(measured[ours]["peak"], measured[other]["peak"]),
        )
        for ours, other, goal in PAIRS
        if ours in measured and other in measured
    ]
    write_rows(arguments.json, rows)


if __name__ == "__main__":
    main()
