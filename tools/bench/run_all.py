"""Run every vescale-vs-native bench, print one table of ratios against their goals.

    .venv/bin/python tools/bench/run_all.py              # the full measurement (tens of minutes)
    .venv/bin/python tools/bench/run_all.py --quick      # every bench, tiny sizes, one block (CI smoke)
    .venv/bin/python tools/bench/run_all.py --check      # exit 1 if a row misses its goal

Each bench runs as its own process with ``--json`` and reports rows made by
``bench_rows.bench_row``: ours against the strongest native PyTorch code for the same job,
timed in alternating blocks (A B A B ...), the ratio being the median of the per-block
ratios with its min-max. Goals: step time and peak memory <= 1.00x the native baseline's;
the checkpoint rows' goal is the fraction of a step that an async save blocks (<= 0.10).
``--quick`` runs one block of tiny sizes so that benches cannot rot; its timings are
noise and are never checked: ``--quick`` exits non-zero only when a bench fails to run. In a
full run a bench that fails is a row that misses its goal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# dp_step's checked variants (deterministic mode is reported by dp_step.py itself, not checked).
NON_DETERMINISTIC = [
    "torch DDP",
    "ours ZeRO-0",
    "torch ZeroRedundancyOptimizer",
    "ours ZeRO-1",
    "torch FSDP2 no reshard",
    "ours ZeRO-2",
    "torch FSDP2",
    "ours ZeRO-3",
]
# name -> (full arguments, quick arguments)
BENCHES: dict[str, tuple[list[str], list[str]]] = {
    "tp_step": (
        ["--tp", "4", "--warmup", "3", "--steps", "10"],
        ["--tp", "2", "--warmup", "1", "--steps", "1", "--layers", "1"],
    ),
    "dp_step": (
        [
            "--dp",
            "4",
            "--width",
            "1024",
            "--layers",
            "6",
            "--rows",
            "8",
            "--steps",
            "3",
            "--repeats",
            "5",
            "--variants",
            *NON_DETERMINISTIC,
        ],
        [
            "--dp",
            "2",
            "--width",
            "128",
            "--layers",
            "2",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--variants",
            *NON_DETERMINISTIC,
        ],
    ),
    "e2e": (
        ["--blocks", "5", "--steps", "3", "--warmup", "2"],
        [
            "--blocks",
            "1",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--hidden",
            "64",
            "--layers",
            "4",
            "--seq",
            "16",
            "--pairs",
            "vescale dp2×tp2 sdpa",
            "vescale pp4 1f1b",
            "vescale pp2×dp2 1f1b",
            "--reuse-ranks",
        ],
    ),
    "checkpoint": (
        ["--async-only", "--mib", "512", "--repeats", "5"],
        ["--async-only", "--mib", "16", "--repeats", "1"],
    ),
}


def run_bench(name: str, quick: bool) -> tuple[list[dict], float, str]:
    """Rows, wall seconds and the output tail of one bench."""
    full, quick_args = BENCHES[name]
    with tempfile.TemporaryDirectory() as scratch:
        rows_path = Path(scratch) / "rows.json"
        command = [sys.executable, str(HERE / f"{name}.py"), *(quick_args if quick else full)]
        command += ["--json", str(rows_path)]
        started = time.perf_counter()
        completed = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)},
        )
        seconds = time.perf_counter() - started
        output = completed.stdout + completed.stderr
        if completed.returncode != 0 or not rows_path.exists():
            failed = {"bench": name, "row": f"FAILED (exit {completed.returncode})", "failed": True}
            return [failed], seconds, output[-3000:]
        return json.loads(rows_path.read_text()), seconds, output


def misses(row: dict) -> list[str]:
    """The goals ``row`` misses."""
    if row.get("failed"):
        return ["ran"]
    missed = []
    if row.get("time_goal") is not None and row["ratio"] > row["time_goal"]:
        missed.append("time")
    memory_ratio, memory_goal = row.get("memory_ratio"), row.get("memory_goal")
    if memory_goal is not None and memory_ratio is not None and memory_ratio > memory_goal:
        missed.append("memory")
    return missed


def _format(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(rows: list[dict], quick: bool) -> None:
    print(
        "| bench | row | ours | native | time ratio, median (min-max), blocks | time goal | "
        "peak memory ratio | memory goal | peak resident ratio (shown) | verdict |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        if row.get("failed"):
            print(f"| {row['bench']} | {row['row']} | | | | | | | | MISS (did not run) |")
            continue
        missed = misses(row)
        verdict = "smoke" if quick else ("ok" if not missed else "MISS " + "+".join(missed))
        unit = row.get("unit", "s")
        ours = f"{row['ours_s'] * 1e3:.1f} ms" if unit == "s" else f"{row['ours_s']:.3f}"
        native = f"{row['native_s'] * 1e3:.1f} ms" if unit == "s" else f"{row['native_s']:.3f}"
        native = "-" if row["native_s"] != row["native_s"] else native  # NaN: no native twin
        spread = f"{row['ratio']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}), {row['blocks']}"
        print(
            f"| {row['bench']} | {row['row']} | {ours} | {native} | {spread} | "
            f"{_format(row.get('time_goal'), 2)} | {_format(row.get('memory_ratio'))} | "
            f"{_format(row.get('memory_goal'), 2)} | {_format(row.get('resident_ratio'))} | {verdict} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one block: a smoke run")
    parser.add_argument("--check", action="store_true", help="exit 1 when a row misses its goal")
    parser.add_argument("--benches", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    parser.add_argument("--json", help="write every row here too")
    parser.add_argument("--logs", help="write each bench's own output (its detailed tables) into this folder")
    arguments = parser.parse_args()
    rows: list[dict] = []
    for name in arguments.benches:
        bench_rows, seconds, output = run_bench(name, arguments.quick)
        print(f"[run_all] {name}: {len(bench_rows)} row(s) in {seconds:.0f} s", flush=True)
        if arguments.logs:
            Path(arguments.logs).mkdir(parents=True, exist_ok=True)
            (Path(arguments.logs) / f"{name}.log").write_text(output)
        if any(row.get("failed") for row in bench_rows):
            print(output, file=sys.stderr)
        rows += bench_rows
    print()
    print_table(rows, arguments.quick)
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(rows, indent=1))
    if arguments.quick:
        failed = [row for row in rows if row.get("failed")]
        return 1 if failed else 0
    missed = [row for row in rows if misses(row)]
    if missed:
        print(f"\n{len(missed)} of {len(rows)} rows miss their goal", file=sys.stderr)
    return 1 if arguments.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
