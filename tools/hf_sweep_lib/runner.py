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


def _rerun_in_float64(
    cells: dict[str, dict[str, Cell]],
    references: dict[str, References],
    world_size: int,
    pool: Any,
    case_timeout_s: float,
    rank_function: Callable,
) -> None:
    """Run each silently wrong cell of ``world_size`` again in float64, where its mode can, and
    replace it by that run's verdict (:class:`hf_sweep_lib.modes.Mode`'s ``judge_float64``): a
    float32 difference that training amplified past the bound is rounding where the float64
    run matches float64 training, a bug where it does not."""
    reruns = []
    for arch, arch_cells in cells.items():
        for mode, cell in arch_cells.items():
            if cell.status != "silent" or MODES[mode].world_size != world_size:
                continue
            make_payload = MODES[mode].float64_payload
            payload = None if make_payload is None else make_payload(references[arch])
            if payload is not None:
                reruns.append((mode, arch, payload))
    if not reruns:
        return
    outcomes = run_batch(pool, world_size, reruns, case_timeout_s, rank_function)
    for (mode, arch, _), outcome in zip(reruns, outcomes, strict=True):
        judge = MODES[mode].judge_float64
        assert judge is not None
        float32 = cells[arch][mode]
        if isinstance(outcome, Cell):  # a hang or a crash of the rerun: the float32 verdict stands
            float32.details["float64"] = outcome.text
        else:
            cells[arch][mode] = judge(outcome, references[arch], float32)


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
            cells[arch][mode] = (
                outcome if isinstance(outcome, Cell) else MODES[mode].judge(outcome, references[arch])
            )
        _rerun_in_float64(cells, references, world_size, pool, case_timeout_s, rank_function)
        for mode, arch, _ in cases:
            if report is not None:
                report(arch, mode, cells[arch][mode])
    ordered = {
        arch: {mode: arch_cells[mode] for mode in modes if mode in arch_cells}
        for arch, arch_cells in cells.items()
    }
    return ordered, not_runnable
