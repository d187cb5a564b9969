"""The sweep's modes: what each sends to the ranks and how its results are judged.

A :class:`Mode` names its world size, builds a case's payload from the architecture's
single-process :class:`References`, and turns the ranks' results into a :class:`Cell`.

Example::

    mode = MODES["tp2"]
    payload = mode.payload(References("llama"))
    cell = mode.judge(per_rank_results, References("llama"))
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_sweep_lib.cells import Cell, error_line, judge_losses, judge_step
from hf_sweep_lib.parallelize_modes import (
    CONSTRAINTS,
    PARALLELIZE_WORLD_SIZES,
    SAVE_AFTER,
    STEPS,
    exact_reference_losses,
    reference_losses,
)
from hf_sweep_lib.tp_modes import TP_MODES, exact_reference_step, reference_step

__all__ = ["MODES", "Mode", "References"]


class References:
    """The single-process references of one architecture, each computed on first use."""

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self._cache: dict[str, Any] = {}

    def get(self, name: str, compute: Callable[[str], Any]) -> Any:
        if name not in self._cache:
            self._cache[name] = compute(self.arch)
        return self._cache[name]

    def step(self) -> tuple[float, dict, dict]:
        """Loss, gradients and initial ``state_dict`` of one step."""
        return self.get("step", reference_step)

    def exact_step(self) -> tuple[float, dict] | None:
        """The same step in float64 (None where the model refuses float64): the noise floor."""
        return self.get("exact_step", lambda arch: exact_reference_step(arch, self.step()[2]))

    def losses(self) -> list[float]:
        """The losses of single-process training (``hf_sweep_lib.parallelize_modes``)."""
        return self.get("losses", reference_losses)

    def exact_losses(self) -> list[float] | None:
        """The same training in float64 (None where the model refuses float64): the noise floor."""
        return self.get("exact_losses", exact_reference_losses)


@dataclass(frozen=True)
class Mode:
    """One column of the sweep."""

    name: str
    world_size: int
    payload: Callable[[References], Any]
    judge: Callable[[list[dict[str, Any]], References], Cell]
    # A silently wrong cell's float64 rerun (the same case with the model in float64; None where
    # the mode has none or the model refuses float64), and its judge, given the float32 cell.
    float64_payload: Callable[[References], Any | None] | None = None
    judge_float64: Callable[[list[dict[str, Any]], References, Cell], Cell] | None = None


def _first_error(results: list[dict[str, Any]]) -> Cell | None:
    failed = [result for result in results if "error" in result]
    if not failed:
        return None
    return Cell.from_error(
        failed[0]["error"], max(r["seconds"] for r in results), traceback=failed[0]["traceback"]
    )


def _tp_mode(name: str, tp: int, sequence_parallel: bool) -> Mode:
    def payload(references: References) -> dict[str, Any]:
        return {"tp": tp, "sequence_parallel": sequence_parallel, "state_dict": references.step()[2]}

    def judge(results: list[dict[str, Any]], references: References) -> Cell:
        error = _first_error(results)
        if error is not None:
            return error
        reference_loss, reference_gradients, _ = references.step()
        seconds = max(result["seconds"] for result in results)
        return judge_step(
            results[0]["loss"],
            results[0]["gradients"],
            reference_loss,
            reference_gradients,
            seconds,
            exact=references.exact_step(),
        )

    return Mode(name, tp, payload, judge)


def _ranks_disagree(results: list[dict[str, Any]], key: str, seconds: float) -> Cell | None:
    """Every rank must report the whole batch's loss; a rank that reports another is wrong."""
    for result in results[1:]:
        cell = judge_losses(result[key], results[0][key], seconds)
        if cell.status != "pass":
            return Cell(
                "silent", f"✘ silently wrong: rank {result['rank']} {cell.text.split(': ', 1)[1]}", seconds
            )
    return None


def _parallelize_mode(name: str) -> Mode:
    def payload(references: References) -> dict[str, Any]:
        references.losses()  # a reference that cannot train fails here, before the ranks run
        if name == "ckpt":
            # vescale.save refuses an existing path: a new one inside a fresh directory
            return {"path": os.path.join(tempfile.mkdtemp(prefix="hf-sweep-ckpt-"), "checkpoint")}
        return {"constraints": CONSTRAINTS[name]}

    def judge(results: list[dict[str, Any]], references: References) -> Cell:
        error = _first_error(results)
        if error is not None:
            return error
        seconds = max(result["seconds"] for result in results)
        disagreement = _ranks_disagree(results, "losses", seconds)
        if disagreement is not None:
            return disagreement
        cell = _judge_against(results[0], references.losses(), None, seconds)
        if cell.status == "pass":
            return cell
        # off in float32: judged again against float64 training, allowing the reference's own error
        exact = references.exact_losses()
        return cell if exact is None else _judge_against(results[0], references.losses(), exact, seconds)

    def _judge_against(
        result: dict[str, Any], reference: list[float], exact: list[float] | None, seconds: float
    ) -> Cell:
        if name != "ckpt":
            return judge_losses(result["losses"], reference[:STEPS], seconds, exact=exact)
        saved = judge_losses(
            result["saved_losses"],
            reference[:SAVE_AFTER],
            seconds,
            "loss before the save",
            exact=None if exact is None else exact[:SAVE_AFTER],
        )
        if saved.status != "pass":
            return saved
        resumed = slice(SAVE_AFTER, SAVE_AFTER + len(result["losses"]))
        return judge_losses(
            result["losses"],
            reference[resumed],
            seconds,
            "loss after the load",
            exact=None if exact is None else exact[resumed],
        )

    def float64_payload(references: References) -> dict[str, Any] | None:
        if references.exact_losses() is None:
            return None
        return {**payload(references), "dtype": "float64"}

    def judge_float64(results: list[dict[str, Any]], references: References, float32: Cell) -> Cell:
        """The float64 run against float64 training, with the float32 bounds: rounding is gone
        from both sides, and a placement or reduction bug moves a loss as much as in float32."""
        exact = references.exact_losses()
        assert exact is not None  # float64_payload sends no case without it
        cell = _first_error(results)
        if cell is None:
            seconds = max(result["seconds"] for result in results)
            cell = _ranks_disagree(results, "losses", seconds) or _judge_against(
                results[0], exact, None, seconds
            )
        seconds = float32.seconds + cell.seconds
        details = {"float32": float32.text, "float32_details": float32.details, "float64": cell.details}
        if cell.status == "pass":
            return Cell("pass", "✔ float64", seconds, details)
        found = cell.text.removeprefix("✘ silently wrong: ")
        return Cell("silent", error_line(f"{float32.text}; float64 rerun: {found}"), seconds, details)

    return Mode(name, PARALLELIZE_WORLD_SIZES[name], payload, judge, float64_payload, judge_float64)


MODES: dict[str, Mode] = {name: _tp_mode(name, *setting) for name, setting in TP_MODES.items()}
MODES.update({name: _parallelize_mode(name) for name in PARALLELIZE_WORLD_SIZES})
