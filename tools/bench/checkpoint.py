"""vescale.dcheckpoint against PyTorch DCP on the same state, in the same run, on gloo ranks.

    .venv/bin/python tools/bench/checkpoint.py                 # 512 MiB in 64 tensors, 4096 x 16 KiB
    .venv/bin/python tools/bench/checkpoint.py --mib 128 --small-count 1024

Both libraries save the same DTensors (Shard(0) over 2 ranks) into fresh directories under
``--directory``. Times are wall-clock seconds between barriers (so the slowest rank counts).
The raw rate is every rank writing its local tensors' bytes to one file and fsyncing it. Read
amplification loads the 2-rank checkpoint on 4 ranks (dim 0 and dim 1 reshards) and counts
the bytes each rank read through ``read``/``pread`` system calls (``rchar`` of
``/proc/self/io``, which also counts the few bytes of gloo traffic), divided by the bytes
its shards hold; the worst rank is reported. Replicated reading loads the same checkpoint on
4 ranks that each need every tensor whole, and reports the group's total bytes read over the
checkpoint's tensor bytes (ours also by its own ReadStats, which counts only file reads). The
export row runs ``export_hf`` on the large checkpoint in a fresh process and reports its
peak-RSS growth.

The async rows time how long ``save(..., async_save=True)`` blocks the caller, over the same
library's synchronous save of the large state in the same ranks, as the median of
``--repeats`` runs, each in fresh rank processes, cold and prepared runs interleaved, with
the 1-minute load average at each run. A cold run: the first async save of the process
(its staging memory is fresh and faulted in while the caller waits), then the second (the
steady state). A prepared run: ``prepare_async_save`` at start-up, then the first async save. DCP's
``async_save`` runs with a caching stager (on CPU ``DefaultStager`` without pinned or shared
memory, whose ``StateDictStager`` keeps each storage's copy; with an accelerator
``BlockingAsyncStager(cache_staged_state_dict=True)``), so its second save copies into the
first one's staging tensors, as ours does. A deferred run: the first async save with
``defer_copies=True`` (parameters copied on the saving thread, optimizer steps wait for them),
timed as its ``save()`` call and as the call plus an immediate wait for the copies (the worst
case: no forward/backward between the save and the next optimizer step).
Two floor rows show what staging must cost on this machine: copying the rank's tensors into
fresh memory (the cold path's copy), and again into the same, now resident, memory (the
prepared and steady path's copy). The raw rate is the better of two raw writes. The RSS
rows make ``--saves`` async saves of one ``--rss-mib`` state on 2 fresh ranks (keep_last=2)
and give each rank's resident memory after the first and the last save, and its largest
growth over the first. ``--async-only`` prints the async rows alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh

from vescale.dcheckpoint import load, prepare_async_save, save
from vescale.dtensor.placements import distribute_tensor
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.memory import fresh_process_peak_growth


def _state(count: int, numel: int, placements: list[str]) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(0)
    return {
        f"t{index:05d}": distribute_tensor(
            torch.randn(numel // 64, 64, generator=generator), mesh, placements
        )
        for index in range(count)
    }


class _Holder(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))


def _timed(action) -> float:
    # Dirty pages of earlier phases are flushed first, so that their writeback is not billed to
    # whichever library's fsync happens to come next.
    os.sync()
    dist.barrier()
    started = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - started


def _disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _raw_write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as file:
        for tensor in tensors.values():
            file.write(tensor.to_local().contiguous().view(torch.uint8).numpy().data)
        file.flush()
        os.fsync(file.fileno())


def save_side_on_ranks(root: str, count: int, numel: int) -> dict[str, float]:
    root_path = Path(root)
    tensors = _state(count, numel, ["S(0)"])
    holder = _Holder(tensors)
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rank = dist.get_rank()
    results = {"tensor_bytes": tensor_bytes}
    # The best of two: the rate the disk and page cache allow, not a cold first write's.
    results["raw_s"] = min(
        _timed(lambda attempt=attempt: _raw_write(root_path / f"raw-{rank}-{attempt}.bin", tensors))
        for attempt in range(2)
    )
    results["vescale_save_s"] = _timed(lambda: save(root_path / "vescale", {"model": holder}))
    results["dcp_save_s"] = _timed(lambda: dcp.save(dict(tensors), checkpoint_id=root_path / "dcp"))
    results["vescale_load_s"] = _timed(lambda: load(root_path / "vescale", {"model": holder}))
    results["dcp_load_s"] = _timed(lambda: dcp.load(dict(tensors), checkpoint_id=root_path / "dcp"))
    dist.barrier()
    if rank == 0:
        results["vescale_disk"] = _disk_bytes(root_path / "vescale")
        results["dcp_disk"] = _disk_bytes(root_path / "dcp")
    return results


def _copy_into(buffer: torch.Tensor, sources: list[torch.Tensor]) -> None:
    offset = 0
    for source in sources:
        nbytes = source.numel() * source.element_size()
        buffer[offset : offset + nbytes].view(source.dtype).view(source.shape).copy_(source)
        offset += nbytes


def _dcp_caching_stager():
    """DCP's stager that keeps its staging copies for the next save (pinned ones need an accelerator)."""
    if torch.accelerator.is_available():
        return BlockingAsyncStager(cache_staged_state_dict=True)
    # StateDictStager, which DefaultStager runs, caches the CPU copy of each storage it staged.
    return DefaultStager(StagingOptions(False, False, False, False))


def cold_async_on_ranks(root: str, count: int, numel: int) -> dict[str, float]:
    """In fresh rank processes: each library's sync save, first (cold) and second (steady) async save,
    and the floor: this rank's tensors copied into fresh memory, then into the same memory again."""
    root_path = Path(root)
    tensors = _state(count, numel, ["S(0)"])
    holder = _Holder(tensors)
    sources = [tensor.to_local() for tensor in tensors.values()]
    # Alive to the end of the run: freed, its pages would go to the next allocation (the cold save's).
    fresh = torch.empty(sum(source.numel() * source.element_size() for source in sources), dtype=torch.uint8)
    results = {
        "copy_fresh_s": _timed(lambda: _copy_into(fresh, sources)),
        "copy_resident_s": _timed(lambda: _copy_into(fresh, sources)),
        "vescale_sync_s": _timed(lambda: save(root_path / "vescale", {"model": holder})),
        "dcp_sync_s": _timed(lambda: dcp.save(dict(tensors), checkpoint_id=root_path / "dcp")),
    }
    pending = {}
    # DCP's thread runs its collectives on the group it is given: not the default one, which this
    # (main) thread keeps using, as a training loop would.
    group = dist.new_group(backend="gloo")
    stager = _dcp_caching_stager()
    for attempt in ("cold", "steady"):
        results[f"vescale_{attempt}_s"] = _timed(
            lambda attempt=attempt: pending.__setitem__(
                "vescale", save(root_path / f"vescale-{attempt}", {"model": holder}, async_save=True)
            )
        )
        _timed(lambda: pending["vescale"].result())
        results[f"dcp_{attempt}_s"] = _timed(
            lambda attempt=attempt: pending.__setitem__(
                "dcp",
                dcp.async_save(
                    dict(tensors),
                    checkpoint_id=root_path / f"dcp-{attempt}",
                    process_group=group,
                    async_stager=stager,
                ),
            )
        )
        _timed(lambda: pending["dcp"].result())
    return results


def prepared_async_on_ranks(root: str, count: int, numel: int) -> dict[str, float]:
    """In fresh rank processes: ``prepare_async_save``, the first async save, then a sync save."""
    root_path = Path(root)
    holder = _Holder(_state(count, numel, ["S(0)"]))
    results = {"prepare_s": _timed(lambda: prepare_async_save({"model": holder}))}
    pending = {}
    results["vescale_prepared_s"] = _timed(
        lambda: pending.__setitem__(
            "save", save(root_path / "vescale-prepared", {"model": holder}, async_save=True)
        )
    )
    _timed(lambda: pending["save"].result())
    results["vescale_sync_s"] = _timed(lambda: save(root_path / "vescale-sync", {"model": holder}))
    return results


def deferred_async_on_ranks(root: str, count: int, numel: int) -> dict[str, float]:
    """In fresh rank processes: the first async save with ``defer_copies=True`` (the saving thread
    copies the parameters), its wait for the copies right after (the worst case: an optimizer step
    at once, no forward/backward to overlap), then a sync save."""
    from vescale.dcheckpoint.deferred_staging import wait_for_deferred_copies

    root_path = Path(root)
    holder = _Holder(_state(count, numel, ["S(0)"]))
    pending = {}
    results = {
        "vescale_deferred_s": _timed(
            lambda: pending.__setitem__(
                "save",
                save(root_path / "vescale-deferred", {"model": holder}, async_save=True, defer_copies=True),
            )
        )
    }
    results["vescale_deferred_wait_s"] = results["vescale_deferred_s"] + _timed(wait_for_deferred_copies)
    _timed(lambda: pending["save"].result())
    results["vescale_sync_s"] = _timed(lambda: save(root_path / "vescale-sync", {"model": holder}))
    return results


def async_blocking(scratch: Path, repeats: int, numel: int) -> dict[str, list[float]]:
    """Each async measure over its run's sync save (and the floor copies), one value per run."""
    ratios: dict[str, list[float]] = {"load": []}
    for repeat in range(repeats):
        for kind, body in (
            ("cold", cold_async_on_ranks),
            ("prepared", prepared_async_on_ranks),
            ("deferred", deferred_async_on_ranks),
        ):
            shutdown_rank_pool()  # fresh ranks: no staging memory left from an earlier run
            root = scratch / f"async-{kind}-{repeat}"
            root.mkdir()
            times = run_on_ranks(body, 2, args=(str(root), 64, numel), timeout_s=1800)[0]
            ratios["load"].append(os.getloadavg()[0])
            for key, seconds in times.items():
                library = "dcp" if key.startswith("dcp") else "vescale"
                if not key.endswith("sync_s"):
                    ratios.setdefault(key, []).append(seconds / times[f"{library}_sync_s"])
                ratios.setdefault(f"{key}_abs", []).append(seconds)
    return ratios


def print_async_rows(ratios: dict[str, list[float]], mib: int) -> None:
    loads = ratios["load"]
    print(
        f"\nasync blocking over a sync save of {mib} MiB, median of {len(loads) // 2} runs each "
        f"(1-min load average {statistics.median(loads):.1f}, {min(loads):.1f}-{max(loads):.1f}):\n"
    )
    print("| measure | vescale.dcheckpoint | PyTorch DCP | goal |")
    print("|---|---|---|---|")

    def cell(key: str) -> str:
        if key not in ratios:
            return "-"
        values = ratios[key]
        seconds = statistics.median(ratios[f"{key}_abs"])
        return f"{statistics.median(values):.1%} ({min(values):.1%}-{max(values):.1%}; {seconds:.3f} s)"

    def seconds(key: str) -> str:
        values = ratios[f"{key}_abs"]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    print(_row("sync save (s)", seconds("vescale_sync_s"), seconds("dcp_sync_s"), ""))
    for name, key in (
        ("async, first save of a process (cold)", "cold_s"),
        ("async, first save after prepare_async_save", "prepared_s"),
        ("async, second save (steady)", "steady_s"),
        ("async, first save with defer_copies: save() call", "deferred_s"),
        ("async, first save with defer_copies: call + waiting for the copies at once", "deferred_wait_s"),
    ):
        print(_row(name, cell(f"vescale_{key}"), cell(f"dcp_{key}"), "<= 10%"))
    print(_row("prepare_async_save (s)", seconds("prepare_s"), "-", ""))
    print(_row("floor: the rank's tensors copied into fresh memory", cell("copy_fresh_s"), "-", ""))
    print(_row("floor: the same copy into resident memory", cell("copy_resident_s"), "-", ""))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_over_async_saves_on_ranks(root: str, count: int, numel: int, saves: int) -> list[int]:
    """This rank's resident bytes after each of ``saves`` async saves of the same state (keep_last=2)."""
    holder = _Holder(_state(count, numel, ["S(0)"]))
    resident = []
    for step in range(saves):
        save(Path(root) / f"step-{step:03d}", {"model": holder}, async_save=True, keep_last=2).result()
        resident.append(_resident_bytes())
    return resident


def _rchar() -> int:
    with open("/proc/self/io") as io_counters:
        return next(int(line.split()[1]) for line in io_counters if line.startswith("rchar"))


def reshard_on_ranks(root: str, count: int, numel: int) -> dict[str, float]:
    results = {}
    for placements in (["S(0)"], ["S(1)"]):
        tensors = _state(count, numel, placements)
        needed = sum(t.to_local().numel() * t.element_size() for t in tensors.values())
        for library in ("vescale", "dcp"):
            before = _rchar()
            if library == "vescale":
                load(Path(root) / "vescale", {"model": _Holder(tensors)})
            else:
                dcp.load(dict(tensors), checkpoint_id=Path(root) / "dcp")
            results[f"{library}_{placements[0]}"] = (_rchar() - before) / needed
    return results


def replicated_on_ranks(root: str, count: int, numel: int) -> dict[str, float]:
    """Every rank needs every tensor whole: bytes the group reads, per library, and ours by ReadStats."""
    tensors = _state(count, numel, ["R"])
    results = {}
    for library in ("vescale", "dcp"):
        before = _rchar()
        if library == "vescale":
            stats = load(Path(root) / "vescale", {"model": _Holder(tensors)}).stats
            results["vescale_stats"] = stats.bytes_read
        else:
            dcp.load(dict(tensors), checkpoint_id=Path(root) / "dcp")
        results[library] = _rchar() - before
    return results


def _export_peak_growth(checkpoint: Path, out_dir: Path) -> int:
    return fresh_process_peak_growth(
        "from vescale.dcheckpoint import export_hf",
        "export_hf(sys.argv[1], sys.argv[2])",
        str(checkpoint),
        str(out_dir),
        timeout_s=1800,
    )


def _row(name: str, vescale_value: str, dcp_value: str, goal: str) -> str:
    return f"| {name} | {vescale_value} | {dcp_value} | {goal} |"


def print_main_rows(scratch: Path, args: argparse.Namespace) -> None:
    """Save, load, reshard, disk, RSS and export rows, against DCP, in one run each."""
    large_root, small_root = scratch / "large", scratch / "small"
    large_root.mkdir()
    small_root.mkdir()
    large_numel = args.mib * (1 << 20) // 4 // 64
    # Every timing spans barriers, so rank 0's times are the slowest rank's; rank 0 also measured disk.
    large = run_on_ranks(save_side_on_ranks, 2, args=(str(large_root), 64, large_numel), timeout_s=1800)[0]
    small_args = (str(small_root), args.small_count, 4096)
    small = run_on_ranks(save_side_on_ranks, 2, args=small_args, timeout_s=1800)[0]
    per_rank = run_on_ranks(reshard_on_ranks, 4, args=(str(large_root), 64, large_numel), timeout_s=1800)
    reshard = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    per_rank = run_on_ranks(replicated_on_ranks, 4, args=(str(large_root), 64, large_numel), timeout_s=1800)
    replicated = {key: sum(r[key] for r in per_rank) for key in per_rank[0]}
    export_growth = _export_peak_growth(large_root / "vescale", scratch / "hf-export")
    rss_root = scratch / "rss"
    rss_root.mkdir()
    rss_numel = args.rss_mib * (1 << 20) // 4 // 64
    rss_per_rank = run_on_ranks(
        rss_over_async_saves_on_ranks, 2, args=(str(rss_root), 64, rss_numel, args.saves), timeout_s=1800
    )
    large_bytes = large["tensor_bytes"]
    raw_rate = large_bytes / large["raw_s"]
    print(f"2 gloo ranks; large: 64 tensors, {large_bytes >> 20} MiB; small: {args.small_count} x 16 KiB")
    print(f"raw write+fsync rate in this run: {raw_rate / 2**20:.0f} MiB/s\n")
    print("| measure | vescale.dcheckpoint | PyTorch DCP | goal |")
    print("|---|---|---|---|")
    for library in ("vescale", "dcp"):
        large[f"{library}_rate"] = large_bytes / large[f"{library}_save_s"] / raw_rate
    print(
        _row(
            "large save (fraction of raw rate)",
            f"{large['vescale_rate']:.2f}",
            f"{large['dcp_rate']:.2f}",
            ">= 0.9",
        )
    )
    print(
        _row(
            "large save / load (s)",
            f"{large['vescale_save_s']:.2f} / {large['vescale_load_s']:.2f}",
            f"{large['dcp_save_s']:.2f} / {large['dcp_load_s']:.2f}",
            "",
        )
    )
    print(
        _row(
            "small save / load (s)",
            f"{small['vescale_save_s']:.2f} / {small['vescale_load_s']:.2f}",
            f"{small['dcp_save_s']:.2f} / {small['dcp_load_s']:.2f}",
            "<= 0.5 each",
        )
    )
    for name, result, tensor_bytes in (
        ("large", large, large_bytes),
        ("small", small, small["tensor_bytes"]),
    ):
        overheads = [result.get(f"{library}_disk", 0) / tensor_bytes - 1 for library in ("vescale", "dcp")]
        print(_row(f"{name} disk overhead", f"{overheads[0]:.2%}", f"{overheads[1]:.2%}", "<= 3%"))
    print(
        _row(
            "reshard 2->4 dim 0: bytes read / needed",
            f"{reshard['vescale_S(0)']:.3f}",
            f"{reshard['dcp_S(0)']:.3f}",
            "<= 1.05",
        )
    )
    print(
        _row(
            "reshard 2->4 dim 1: bytes read / needed",
            f"{reshard['vescale_S(1)']:.3f}",
            f"{reshard['dcp_S(1)']:.3f}",
            "<= 1.10",
        )
    )
    ours = f"{replicated['vescale'] / large_bytes:.3f}"
    print(
        _row(
            "replicated on 4 ranks: group bytes read / checkpoint",
            f"{ours} (ReadStats {replicated['vescale_stats'] / large_bytes:.3f})",
            f"{replicated['dcp'] / large_bytes:.3f}",
            "<= 1.05",
        )
    )
    for rank, resident in enumerate(rss_per_rank):
        growth = [value - resident[0] for value in resident]
        print(
            _row(
                f"RSS over {args.saves} async saves of {args.rss_mib} MiB, rank {rank}: "
                "after 1st / last, MiB (max growth)",
                f"{resident[0] / 2**20:.0f} / {resident[-1] / 2**20:.0f} (+{max(growth) / 2**20:.1f})",
                "-",
                "stable",
            )
        )
    largest = large_bytes // 64
    print(
        _row(
            f"export_hf peak RSS growth, MiB (largest tensor {largest >> 20} MiB)",
            f"{export_growth / 2**20:.0f}",
            "-",
            f"<= {(largest >> 20) + 64}",
        )
    )


def main() -> None:
    from bench_rows import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--mib", type=int, default=512, help="size of the large state, in 64 tensors")
    parser.add_argument("--small-count", type=int, default=4096, help="number of 16 KiB tensors")
    parser.add_argument("--directory", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--rss-mib", type=int, default=128, help="state size of the RSS-over-saves run")
    parser.add_argument("--saves", type=int, default=20, help="async saves in the RSS-over-saves run")
    parser.add_argument("--repeats", type=int, default=5, help="cold and prepared async runs (each)")
    parser.add_argument("--async-only", action="store_true", help="print the async rows alone")
    parser.add_argument("--json", help="write the checked async rows here (for run_all.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.directory) as scratch:
        if not args.async_only:
            print_main_rows(Path(scratch), args)
        large_numel = args.mib * (1 << 20) // 4 // 64
        ratios = async_blocking(Path(scratch), args.repeats, large_numel)
        print_async_rows(ratios, args.mib)
    from bench_rows import write_rows

    write_rows(args.json, async_rows(ratios))


def async_rows(ratios: dict[str, list[float]]) -> list[dict]:
    """run_all rows: the fraction of a sync save that each async save blocks (goal <= 10%), DCP's beside."""
    rows = []
    for name, key in (
        ("async save blocking / sync save, first of a process", "cold_s"),
        ("async save blocking / sync save, first after prepare_async_save", "prepared_s"),
        ("async save blocking / sync save, steady", "steady_s"),
        ("async save blocking / sync save, first with defer_copies (save call)", "deferred_s"),
    ):
        ours = ratios.get(f"vescale_{key}")
        if not ours:
            continue
        dcp_values = ratios.get(f"dcp_{key}")
        rows.append(
            {
                "bench": "checkpoint",
                "row": name,
                "unit": "fraction",
                "ours_s": statistics.median(ours),
                "native_s": statistics.median(dcp_values) if dcp_values else float("nan"),
                "blocks": len(ours),
                "ratio": statistics.median(ours),
                "ratio_min": min(ours),
                "ratio_max": max(ours),
                "memory_ratio": None,
                "time_goal": 0.10,
                "memory_goal": None,
                "note": "ours and native: the fraction itself (native: DCP async_save), not a ratio",
            }
        )
    return rows


if __name__ == "__main__":
    main()
