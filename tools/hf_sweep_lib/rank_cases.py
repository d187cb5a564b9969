"""The rank side of the sweep: run a batch of (mode, architecture) cases in one process group.

One ``run_on_ranks`` call runs many cases, so that the rank processes, their process group
and the machine-wide rank lock are taken once per batch rather than once per cell. A case's
exception is returned as its result (with the rank's traceback), never raised: an error that
every rank shares (a plan error, a shape error) costs nothing more. A hang or a crash fails
the whole batch; the parent then runs its cases one by one (``hf_sweep_lib.batches``).

Example::

    results = run_on_ranks(run_cases_on_rank, 2, args=([("tp2", "llama", payload)],))
    results[0][0]   # rank 0's result of the first case: {"loss": ..., "gradients": ...}
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RAISED_WAIT_S", "RANK_FUNCTIONS", "quiet", "run_cases_on_rank"]


def quiet() -> None:
    """Silence transformers' and veScale's warnings in this process."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("vescale").setLevel(logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)


def _rank_functions() -> dict[str, Callable[[str, Any], dict[str, Any]]]:
    from hf_sweep_lib.parallelize_modes import PARALLELIZE_RANK_FUNCTIONS
    from hf_sweep_lib.tp_modes import TP_MODES, tp_step_on_rank

    functions: dict[str, Callable[[str, Any], dict[str, Any]]] = {mode: tp_step_on_rank for mode in TP_MODES}
    functions.update(PARALLELIZE_RANK_FUNCTIONS)
    return functions


# How long a rank whose case raised waits for its peers before it takes them for hung.
RAISED_WAIT_S = 30.0
RANK_FUNCTIONS: dict[str, Callable[[str, Any], dict[str, Any]]] = {}


def _record(directory: str | None, name: str, value: Any) -> None:
    if directory is None:
        return
    temporary = os.path.join(directory, f".{name}.tmp")
    with open(temporary, "wb") as output:
        pickle.dump(value, output)
    os.replace(temporary, os.path.join(directory, name))  # readers never see half a file


def run_cases_on_rank(
    cases: list[tuple[str, str, Any]], case_timeout_s: float = 120.0, results_directory: str | None = None
) -> list[dict[str, Any]]:
    """Run each ``(mode, arch, payload)`` case on this rank; one result dict per case.

    Each result is also written to ``results_directory`` as it comes (``{index}-{rank}.pkl``), so
    that the parent keeps the finished cases of a batch that dies later. A case that runs longer
    than ``case_timeout_s`` ends this rank (``hang-{index}-{rank}`` is written first), and so does
    a peer that is not back from the same case by then (``desync-{index}-{rank}``): a batch never
    waits for its whole timeout on one hung case.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hf_sweep_lib.cells import error_line

    quiet()
    if not RANK_FUNCTIONS:
        RANK_FUNCTIONS.update(_rank_functions())
    rank = dist.get_rank()
    results = []
    for index, (mode, arch, payload) in enumerate(cases):
        started = time.perf_counter()
        torch.manual_seed(0)
        watchdog = threading.Timer(case_timeout_s, _give_up, args=(results_directory, f"hang-{index}-{rank}"))
        watchdog.daemon = True
        watchdog.start()
        try:
            result = RANK_FUNCTIONS[mode](arch, payload)
        except Exception as error:
            result = {"error": error_line(error, None), "traceback": traceback.format_exc()[-4000:]}
        finally:
            watchdog.cancel()
        result["seconds"] = time.perf_counter() - started
        result["rank"] = rank
        _record(results_directory, f"{index}-{rank}.pkl", result)
        results.append(result)
        if len(cases) > 1:
            # A rank that raised waits less: its peers raised too (and come at once) or wait for it.
            wait_s = RAISED_WAIT_S if "error" in result else case_timeout_s
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=wait_s))
            except RuntimeError:
                _give_up(results_directory, f"desync-{index}-{rank}")
    return results


def _give_up(directory: str | None, marker: str) -> None:
    """End this rank at once (a hung collective cannot be interrupted), leaving ``marker``."""
    _record(directory, marker, marker)
    sys.stdout.flush()
    os._exit(3)
