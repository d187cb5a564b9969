"""One bench row: ours against the native baseline, with its goal; written as JSON for run_all.py.

Every bench that ``tools/bench/run_all.py`` runs takes ``--json PATH`` and writes a list of
these rows there; run_all prints them in one table and ``--check`` fails on a missed goal.
A bench's command line starts from :func:`bench_parser`, its module docstring as the help.

Example::

    row = bench_row("dp_step", "ZeRO-0 vs DDP", ours_times, native_times, ours_peak, native_peak)
    write_rows("/tmp/rows.json", [row])
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence

__all__ = ["bench_parser", "bench_row", "write_rows"]


def bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A bench's argument parser, whose ``--help`` prints ``description`` (its module docstring) as written.

    Example::

        parser = bench_parser(__doc__)
        parser.add_argument("--steps", type=int, default=3)
    """
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


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
    note: str = "",
) -> dict:
    """A row from paired per-block times (block ``i`` of ours ran beside block ``i`` of native).

    The ratio is the median of the per-block ratios (with their min-max); ``time_goal`` and
    ``memory_goal`` are upper bounds on the time and peak-memory ratios (``None``: reported only).
    """
    ratios = [mine / theirs for mine, theirs in zip(ours, native, strict=True)]
    memory_ratio = None
    if ours_peak is not None and native_peak is not None:
        memory_ratio = ours_peak / max(native_peak, 1.0)
    return {
        "bench": bench,
        "row": name,
        "ours_s": statistics.median(ours),
        "native_s": statistics.median(native),
        "blocks": len(ratios),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "memory_ratio": memory_ratio,
        "time_goal": time_goal,
        "memory_goal": memory_goal,
        "note": note,
    }


def write_rows(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` as JSON to ``path`` (nothing when ``path`` is ``None``)."""
    if path:
        with open(path, "w") as handle:
            json.dump(rows, handle, indent=1)
