"""One bench row: ours against the native baseline, with its goal; written as JSON for run_all.py.

Every bench that ``tools/bench/run_all.py`` runs takes ``--json PATH`` and writes a list of
these rows there; run_all prints them in one table and ``--check`` fails on a missed goal.
A bench's command line starts from :func:`bench_parser`, its module docstring as the help; its
``--malloc`` option (see :data:`MALLOC_SETTINGS`) sets glibc's allocator for the rank processes.

Example::

    row = bench_row("dp_step", "ZeRO-0 vs DDP", ours_times, native_times, ours_peak, native_peak)
    write_rows("/tmp/rows.json", [row])
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["MALLOC_SETTINGS", "BenchParser", "bench_parser", "bench_row", "write_rows"]

# glibc's malloc serves a block of at least its mmap threshold by mmap (fresh pages, faulted in on
# first touch, returned on free) and the rest from its heap, which it trims above the trim
# threshold. Both start at 128 KiB and 256 KiB and move up to the largest mmap'ed block the
# process has freed so far (at most 32 MiB, and twice that for the trim). A step's temporaries
# are then either reused or faulted in again every step, depending on what a side happened to free
# once before: torch DDP frees its first 24 MiB bucket when it rebuilds them, our DDP keeps its
# buckets, and in dp_step's 6 x Linear(1024, 1024) step that alone put 11,104 page faults (4 KiB
# each, AdamW's 4 MiB temporaries) into every one of our optimizer steps and none into DDP's (34
# against 16 ms of CPU time). "steady" fixes the two thresholds where glibc settles by itself once
# a 32 MiB block has been freed (any model whose activations pass 32 MiB), the same for both sides;
# "default" leaves glibc's own history-dependent state. A MALLOC_* variable set by the caller wins.
MALLOC_SETTINGS: dict[str, dict[str, str]] = {
    "steady": {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(64 * 2**20)},
    "default": {},
}


class BenchParser(argparse.ArgumentParser):
    """An argument parser with ``--malloc``, applied (into ``os.environ``, for the rank processes that
    the bench starts afterwards) when the arguments are parsed."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """Parse, then set the allocator variables of ``--malloc`` where the caller has not."""
        arguments = super().parse_args(args, namespace)
        for name, value in MALLOC_SETTINGS[arguments.malloc].items():
            os.environ.setdefault(name, value)
        return arguments


def bench_parser(description: str | None) -> BenchParser:
    """A bench's argument parser, whose ``--help`` prints ``description`` (its module docstring) as written,
    with ``--malloc`` (default ``steady``, see :data:`MALLOC_SETTINGS`).

    Example::

        parser = bench_parser(__doc__)
        parser.add_argument("--steps", type=int, default=3)
    """
    parser = BenchParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--malloc",
        choices=list(MALLOC_SETTINGS),
        default="steady",
        help="glibc allocator thresholds for the rank processes: fixed at glibc's settled values for "
        "both sides (steady) or glibc's history-dependent defaults (default)",
    )
    return parser


def bench_row(
    bench: str,
    name: str,
    ours: Sequence[float],
    native: Sequence[float],
    ours_peak: float | None = None,
    native_peak: float | None = None,
    *,
    time_goal: float | None = 1.0,
    memory_goal: float | None = 1.0,
    resident_peaks: tuple[float, float] | None = None,
    note: str = "",
) -> dict:
    """A row from paired per-block times (block ``i`` of ours ran beside block ``i`` of native).

    The ratio is the median of the per-block ratios (with their min-max); ``time_goal`` and
    ``memory_goal`` are upper bounds on the time and peak-memory ratios (``None``: reported only).
    ``resident_peaks`` (ours, native), where the checked peaks are malloc's bytes in use, are
    the resident-set peaks beside them, reported only.
    """
    ratios = [mine / theirs for mine, theirs in zip(ours, native, strict=True)]
    memory_ratio = None
    if ours_peak is not None and native_peak is not None:
        memory_ratio = ours_peak / max(native_peak, 1.0)
    resident_ratio = None
    if resident_peaks is not None:
        resident_ratio = resident_peaks[0] / max(resident_peaks[1], 1.0)
    return {
        "bench": bench,
        "row": name,
        "ours_s": statistics.median(ours),
        "native_s": statistics.median(native),
        "blocks": len(ratios),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ours_peak": ours_peak,
        "native_peak": native_peak,
        "memory_ratio": memory_ratio,
        "resident_ratio": resident_ratio,
        "time_goal": time_goal,
        "memory_goal": memory_goal,
        "note": note,
    }


def write_rows(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` as JSON to ``path`` (nothing when ``path`` is ``None``)."""
    if path:
        with open(path, "w") as handle:
            json.dump(rows, handle, indent=1)
