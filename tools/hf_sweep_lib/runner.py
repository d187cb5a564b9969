"""Run a group of architectures in every chosen mode: references here, cases on the ranks.

The single-process references are computed in this process (one thread, as the ranks run);
an architecture whose reference cannot train is recorded as not runnable, with the reason.
The cases of all architectures that share a world size run as one batch
(:func:`hf_sweep_lib.batches.run_batch`).

Example::

    cells, not_runnable = run_architectures(["llama", "gpt2"], ["tp2", "tp4"], RankPool(), 120.0)
    cells["llama"]["tp4"].status     # "pass", "error" or "silent"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_sweep_lib.batches import run_batch
from hf_sweep_lib.cells import Cell
from hf_sweep_lib.modes import MODES, References
from hf_sweep_lib.rank_cases import run_cases_on_rank

__all__ = ["run_architectures"]


def _print_cell(arch: str, mode: str, cell: Cell) -> None:
    print(f"{arch:28s} {mode:14s} {cell.seconds:6.1f}s {cell.text}", flush=True)


def run_architectures(
    archs: list[str],
    modes: list[str],
    pool: Any,
    case_timeout_s: float,
    rank_function: Callable = run_cases_on_rank,
    report: Callable[[str, str, Cell], None] | None = _print_cell,
) -> tuple[dict[str, dict[str, Cell]], dict[str, str]]:
    """Each runnable architecture's cell per mode, and the others' reasons for not running."""
    import torch

    from vescale.dtensor.testing.models.hf_architectures import one_process_failure

    torch.set_num_threads(1)  # the reference runs as the ranks do
    references: dict[str, References] = {}
    not_runnable: dict[str, str] = {}
    for arch in archs:
        reason = one_process_failure(arch)
        if reason is None:
            references[arch] = References(arch)
        else:
            not_runnable[arch] = reason
            if report is not None:
                print(f"{arch:28s} not runnable in one process: {reason}", flush=True)
    cells: dict[str, dict[str, Cell]] = {arch: {} for arch in references}
    for world_size in sorted({MODES[mode].world_size for mode in modes}):
        cases = []
        for arch, arch_references in references.items():
            for mode in modes:
                if MODES[mode].world_size != world_size:
                    continue
                try:
                    cases.append((mode, arch, MODES[mode].payload(arch_references)))
                except Exception as error:  # the reference fails in this mode: recorded, never fatal
                    cells[arch][mode] = Cell.from_error(error)
        outcomes = run_batch(pool, world_size, cases, case_timeout_s, rank_function)
        for (mode, arch, _), outcome in zip(cases, outcomes, strict=True):
            cell = outcome if isinstance(outcome, Cell) else MODES[mode].judge(outcome, references[arch])
            cells[arch][mode] = cell
            if report is not None:
                report(arch, mode, cell)
    ordered = {
        arch: {mode: arch_cells[mode] for mode in modes if mode in arch_cells}
        for arch, arch_cells in cells.items()
    }
    return ordered, not_runnable
