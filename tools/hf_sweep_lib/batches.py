"""Run many sweep cases in one ``run_on_ranks`` call, and isolate the ones that hang.

A batch runs its cases in order on the same ranks (:func:`hf_sweep_lib.rank_cases.run_cases_on_rank`).
Where the batch hangs or crashes, or one case ends differently on different ranks (so that the
ranks may no longer be in step), the cases not yet trusted run again one per call, each under
its own timeout: a hang fails its own cell, never the sweep.

Example::

    outcomes = run_batch(pool, 2, [("tp2", "llama", payload)], case_timeout_s=120.0)
    outcomes[0]   # per-rank result dicts, or a Cell for a hang/crash
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from hf_sweep_lib.cells import Cell
from hf_sweep_lib.rank_cases import run_cases_on_rank

__all__ = ["run_batch"]

# Beyond the cases' own time limits (enforced on the ranks), for starting and reporting.
BATCH_BASE_SECONDS = 60.0


def _call(
    pool: Any, world_size: int, cases: list, case_timeout_s: float, rank_function: Callable
) -> list[list[dict[str, Any]] | Cell]:
    """Run ``cases`` in one call; what each finished case returned, and a Cell for where it broke.

    The list is shorter than ``cases`` where the call died: its last entry is then the Cell of
    the case that hung (or that left the ranks out of step) and later cases have no entry.
    """
    from vescale.dtensor.testing import RankTimeoutError

    directory = tempfile.mkdtemp(prefix="hf-sweep-results-")
    timeout_s = BATCH_BASE_SECONDS + case_timeout_s * len(cases)
    try:
        per_rank = pool.run(
            rank_function,
            world_size,
            (cases, case_timeout_s, directory),
            None,
            timeout_s=timeout_s,
            backend="gloo",
            seed=0,
            error_grace_s=5.0,
        )
        return [[per_rank[rank][index] for rank in range(world_size)] for index in range(len(cases))]
    except RankTimeoutError:
        failure = Cell.from_error(f"hang: no result within {timeout_s:g} s (the ranks were killed)")
    except Exception as error:  # a rank crashed, gave up on a hung case, or raised outside a case
        cause = error.__cause__ if isinstance(error.__cause__, BaseException) else error
        failure = Cell.from_error(cause)
    finally:
        saved = _saved_results(directory, world_size, len(cases))
        shutil.rmtree(directory, ignore_errors=True)
    finished, markers, partial = saved
    index = len(finished)
    if index < len(cases):
        raised = [result for result in partial if "error" in result]
        if raised:
            # one rank raised and left its peers waiting in a collective: a hang caused by that error
            others = sorted(set(range(world_size)) - {result["rank"] for result in partial})
            failure = Cell.from_error(
                f"rank {raised[0]['rank']} raised, ranks {others} hung: {raised[0]['error']}",
                traceback=raised[0]["traceback"],
            )
            failure.details["error"] = raised[0]["error"]
        elif markers.get(index):
            failure = Cell.from_error(f"hang: the case did not finish within {case_timeout_s:g} s")
        return [*finished, failure]
    return finished


def _saved_results(
    directory: str, world_size: int, count: int
) -> tuple[list[list[dict[str, Any]]], dict[int, list[str]], list[dict[str, Any]]]:
    """The cases every rank finished (in order, up to the first missing one), the give-up markers,
    and the results that some ranks saved for the first case not every rank finished."""
    names = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    markers: dict[int, list[str]] = {}
    for name in names:
        if name.startswith(("hang-", "desync-")):
            markers.setdefault(int(name.split("-")[1]), []).append(name)
    finished = []
    for index in range(count):
        files = [os.path.join(directory, f"{index}-{rank}.pkl") for rank in range(world_size)]
        if not all(os.path.exists(file) for file in files) or index in markers:
            partial = []
            for file in files:
                if os.path.exists(file):
                    with open(file, "rb") as result_file:
                        partial.append(pickle.load(result_file))
            return finished, markers, partial
        results = []
        for file in files:
            with open(file, "rb") as result_file:
                results.append(pickle.load(result_file))
        finished.append(results)
    return finished, markers, []


def _in_step(results: list[dict[str, Any]]) -> bool:
    """Whether every rank ended the case the same way (all fine, or all with the same error)."""
    return len({result.get("error") for result in results}) == 1


def run_batch(
    pool: Any,
    world_size: int,
    cases: list[tuple[str, str, Any]],
    case_timeout_s: float,
    rank_function: Callable = run_cases_on_rank,
) -> list[list[dict[str, Any]] | Cell]:
    """Each case's per-rank results (or an error Cell), running the cases together where it can.

    A batch that breaks keeps its finished cases; the case it broke on is recorded (a hang) or
    run again alone (ranks out of step), and the cases after it run as a new batch.
    ``rank_function`` is :func:`run_cases_on_rank` or a module-level function that calls it
    (a test file's, whose ranks cannot import ``hf_sweep_lib`` by name).
    """
    outcomes: list[list[dict[str, Any]] | Cell] = []
    while len(outcomes) < len(cases):
        first = len(outcomes)
        remaining = cases[first:]
        for position, results in enumerate(_call(pool, world_size, remaining, case_timeout_s, rank_function)):
            if isinstance(results, Cell):
                if len(remaining) > 1 and not results.text.startswith(("hang: the case", "rank ")):
                    # a crash or ranks out of step: the case alone tells its own outcome
                    results = _call(pool, world_size, [remaining[position]], case_timeout_s, rank_function)[0]
                outcomes.append(results)
                break
            outcomes.append(results)
            if not _in_step(results):
                break  # later cases may have run on ranks out of step: they run again
        if len(outcomes) == first:
            outcomes.append(Cell.from_error("the ranks returned no result"))
    return outcomes
