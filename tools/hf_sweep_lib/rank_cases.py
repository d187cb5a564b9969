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

import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RANK_FUNCTIONS", "quiet", "run_cases_on_rank"]


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


RANK_FUNCTIONS: dict[str, Callable[[str, Any], dict[str, Any]]] = {}


def run_cases_on_rank(cases: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
    """Run each ``(mode, arch, payload)`` case on this rank; one result dict per case."""
    import torch
    import torch.distributed as dist

    from hf_sweep_lib.cells import error_line

    quiet()
    if not RANK_FUNCTIONS:
        RANK_FUNCTIONS.update(_rank_functions())
    results = []
    for mode, arch, payload in cases:
        started = time.perf_counter()
        torch.manual_seed(0)
        try:
            result = RANK_FUNCTIONS[mode](arch, payload)
        except Exception as error:
            result = {"error": error_line(error, None), "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = time.perf_counter() - started
        result["rank"] = dist.get_rank()
        results.append(result)
    return results
