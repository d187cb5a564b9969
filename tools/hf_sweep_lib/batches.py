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

from collections.abc import Callable
from typing import Any

from hf_sweep_lib.cells import Cell
from hf_sweep_lib.rank_cases import run_cases_on_rank

__all__ = ["run_batch"]

# A batch may take this long per case before it is taken for hung (then its cases run alone).
BATCH_SECONDS_PER_CASE = 20.0
BATCH_BASE_SECONDS = 60.0


def _call(
    pool: Any, world_size: int, cases: list, timeout_s: float, rank_function: Callable
) -> list[list[dict[str, Any]]] | Cell:
    from vescale.dtensor.testing import RankTimeoutError

    try:
        per_rank = pool.run(
            rank_function,
            world_size,
            (cases,),
            None,
            timeout_s=timeout_s,
            backend="gloo",
            seed=0,
            error_grace_s=5.0,
        )
    except RankTimeoutError:
        return Cell.from_error(f"hang: no result within {timeout_s:g} s (the ranks were killed)")
    except Exception as error:  # a rank crashed, or raised outside a case's own handler
        cause = error.__cause__ if isinstance(error.__cause__, BaseException) else error
        return Cell.from_error(cause)
    return [[per_rank[rank][index] for rank in range(world_size)] for index in range(len(cases))]


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
    """Each case's per-rank results (or an error Cell), running the batch at once where it can.

    ``rank_function`` is :func:`run_cases_on_rank` or a module-level function that calls it
    (a test file's, whose ranks cannot import ``hf_sweep_lib`` by name).
    """
    if not cases:
        return []
    outcomes: list[list[dict[str, Any]] | Cell | None] = [None] * len(cases)
    if len(cases) > 1:
        batch_timeout = BATCH_BASE_SECONDS + BATCH_SECONDS_PER_CASE * len(cases)
        batch = _call(pool, world_size, cases, batch_timeout, rank_function)
        if not isinstance(batch, Cell):
            for index, results in enumerate(batch):
                outcomes[index] = results
                if not _in_step(results):
                    break  # later cases may have run on ranks out of step: run them again alone
    for index, case in enumerate(cases):
        if outcomes[index] is None:
            single = _call(pool, world_size, [case], case_timeout_s, rank_function)
            outcomes[index] = single if isinstance(single, Cell) else single[0]
    return outcomes  # type: ignore[return-value]
