"""Run every causal-LM architecture of the installed ``transformers`` under veScale's modes.

Each architecture runs at a tiny configuration derived from its own defaults
(``vescale.dtensor.testing.models.hf_architectures``) against a single-process reference;
each cell is ✔, "✘ silently wrong: …" or the error's first line. Rank processes are
reused across architectures; a hang is a failed cell, never a hung sweep.

Example::

    python tools/hf_sweep.py --modes tp2,tp2-sp,tp4 --json /tmp/tp.json
    python tools/hf_sweep.py --subset ci --modes tp2
    python tools/hf_sweep.py --full --markdown docs/models.md
    python tools/hf_sweep.py --merge tp.json pp2.json --markdown docs/models.md
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

TOOLS_DIRECTORY = os.path.dirname(os.path.abspath(__file__))
if TOOLS_DIRECTORY not in sys.path:
    sys.path.insert(0, TOOLS_DIRECTORY)
# Rank processes import the sweep's rank functions (hf_sweep_lib) by name.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TOOLS_DIRECTORY, os.environ.get("PYTHONPATH")]))

from hf_sweep_lib.modes import MODES  # noqa: E402
from hf_sweep_lib.report import (  # noqa: E402
    failure_classes_markdown,
    known_failures_table,
    merge_records,
    write_json,
    write_markdown,
)
from hf_sweep_lib.runner import run_architectures  # noqa: E402
from hf_sweep_lib.subsets import CI_SUBSET  # noqa: E402

logger = logging.getLogger("vescale.tools.hf_sweep")
DEFAULT_TIMEOUT_S = 120.0


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=None, help=f"comma-separated, of {','.join(MODES)} (default: all)")
    parser.add_argument("--archs", default=None, help="comma-separated model types (default: all)")
    parser.add_argument("--subset", choices=["ci"], default=None, help="the fixed CI subset of architectures")
    parser.add_argument("--full", action="store_true", help="every architecture in every mode")
    parser.add_argument("--json", default=None, help="write the record as JSON here")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: merge these records (a later one's cells replace an earlier one's) and write them",
    )
    parser.add_argument("--markdown", default=None, help="write the table here (e.g. docs/models.md)")
    parser.add_argument("--classes", default=None, help="write the failures grouped by error class here")
    parser.add_argument(
        "--jobs", type=int, default=1, help="architectures run at once, each with its own ranks"
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per architecture and mode"
    )
    parser.add_argument(
        "--batch", type=int, default=48, help="architectures whose cases share one run of the ranks"
    )
    parser.add_argument(
        "--known-failures",
        action="store_true",
        help="print the failed cells as test_vescale_hf_sweep.py's KNOWN_FAILURES table",
    )
    parser.add_argument(
        "--no-rank-lock",
        action="store_true",
        help="run the ranks without the machine-wide rank lock (on a machine shared with test runs "
        "that hold it for minutes; run the sweep under `nice` there so that it takes spare CPU only)",
    )
    return parser.parse_args(argv)


def _selected_archs(args: argparse.Namespace) -> list[str]:
    from vescale.dtensor.testing.models.hf_architectures import causal_lm_architectures, split_variant

    available = causal_lm_architectures()
    if args.archs:
        chosen = [arch.strip() for arch in args.archs.split(",") if arch.strip()]
    elif args.subset == "ci":
        chosen = list(CI_SUBSET)
    else:
        chosen = available
    unknown = sorted({arch for arch in chosen if split_variant(arch)[0] not in available})
    if unknown:
        raise SystemExit(f"unknown architectures {unknown}; the installed transformers has {len(available)}")
    return chosen


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=TOOLS_DIRECTORY, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class _Sweep:
    def __init__(self, args: argparse.Namespace, archs: list[str], modes: list[str], argv: list[str]) -> None:
        import torch
        import transformers

        self.args, self.archs, self.modes = args, archs, modes
        self.lock = threading.Lock()
        self.started = time.perf_counter()
        self.record: dict[str, Any] = {
            "meta": {
                "command": " ".join(argv),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "commit": _commit(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "wall_seconds": 0.0,
                "architectures": len(archs),
                "vescale_dmodule": _module_file("vescale.dmodule"),
            },
            "modes": modes,
            "results": {},
            "not_runnable": {},
        }

    def run(self) -> dict[str, Any]:
        size = max(1, self.args.batch)
        chunks = [self.archs[start : start + size] for start in range(0, len(self.archs), size)]
        workers = [
            threading.Thread(target=self._worker, args=(chunks,)) for _ in range(max(1, self.args.jobs))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self._save()
        return self.record

    def _worker(self, chunks: list[list[str]]) -> None:
        from vescale.dtensor.testing import RankPool

        pool = RankPool()
        try:
            while True:
                with self.lock:
                    if not chunks:
                        return
                    chunk = chunks.pop(0)
                self._run_chunk(chunk, pool)
        finally:
            pool.close(kill=True)

    def _run_chunk(self, chunk: list[str], pool: Any) -> None:
        cells, not_runnable = run_architectures(chunk, self.modes, pool, self.args.timeout)
        with self.lock:
            self.record["not_runnable"].update(not_runnable)
            for arch, arch_cells in cells.items():
                self.record["results"][arch] = {mode: cell.to_dict() for mode, cell in arch_cells.items()}
            self._save()

    def _save(self) -> None:
        self.record["meta"]["wall_seconds"] = time.perf_counter() - self.started
        if self.args.json:
            write_json(self.record, self.args.json)
        if self.args.markdown:
            write_markdown(self.record, self.args.markdown)
        if self.args.classes:
            with open(self.args.classes, "w", encoding="utf-8") as output:
                output.write(failure_classes_markdown(self.record, self.modes))


def _module_file(name: str) -> str:
    import importlib

    return getattr(importlib.import_module(name), "__file__", "") or ""


def _merge(args: argparse.Namespace) -> int:
    import json

    records = []
    for path in args.merge:
        with open(path, encoding="utf-8") as record_file:
            records.append(json.load(record_file))
    record = merge_records(records)
    if args.json:
        write_json(record, args.json)
    if args.markdown:
        write_markdown(record, args.markdown)
    print(failure_classes_markdown(record, record["modes"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    if args.no_rank_lock:
        os.environ["VESCALE_TEST_RANK_LOCK"] = "none"
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    if args.merge:
        return _merge(args)
    modes = [mode.strip() for mode in args.modes.split(",")] if args.modes else list(MODES)
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {list(MODES)}")
    sweep = _Sweep(args, _selected_archs(args), modes, argv)
    record = sweep.run()
    print(failure_classes_markdown(record, modes))
    if args.known_failures:
        print(known_failures_table(record))
    print(f"{len(sweep.archs)} architectures, {len(modes)} modes: {record['meta']['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
