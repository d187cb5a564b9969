"""The dpipe acceptance table: loss of each of 10 AdamW steps against single-device training.

Runs :data:`vescale.dpipe.testing.ACCEPTANCE_CASES` (the cases the tests assert, with the
same rank function): tiny Llama (untied) and GPT-2 (tied), PP=2 and PP=4 for each schedule,
PP2xTP2 for each schedule, and PP2xDP2xTP2 with ZeRO-1. Prints per case the worst relative
loss error over the steps and ranks (``|loss - reference| / |reference|``, reference: the
same model on one process, whole batch per step) and whether it is within 1e-4.

    .venv/bin/python tools/dpipe_accuracy.py               # every case (several minutes on 2 cores)
    .venv/bin/python tools/dpipe_accuracy.py llama pp2xtp2  # only rows naming all of these
"""

from __future__ import annotations

import sys
import time

from vescale.dpipe.testing import (
    ACCEPTANCE_CASES,
    LOSS_RTOL,
    max_relative_error,
    pipeline_training_losses,
    reference_training_losses,
)
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool


def _mesh_text(mesh_dims: dict[str, int]) -> str:
    return "x".join(f"{dim}{size}" for dim, size in mesh_dims.items())


def main() -> None:
    wanted = set(sys.argv[1:])
    references: dict[str, list[float]] = {}
    print("| model | mesh | schedule | v | m | max relative loss error | time | status |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for model_name, mesh_dims, plan_dict in ACCEPTANCE_CASES:
            mesh = _mesh_text(mesh_dims) + ("-zero1" if "dp" in mesh_dims else "")
            if not wanted <= {model_name, mesh, plan_dict["schedule"]}:
                continue
            if model_name not in references:
                references[model_name] = reference_training_losses(model_name)
            world_size = 1
            for size in mesh_dims.values():
                world_size *= size
            started = time.perf_counter()
            try:
                results = run_on_ranks(
                    pipeline_training_losses,
                    world_size,
                    args=(model_name, mesh_dims, plan_dict),
                    timeout_s=600,
                )
            except Exception as error:  # a failing case is a row of the table, not the end of it
                print(f"| {model_name} | {mesh} | {plan_dict['schedule']} | | | | | FAILED: {error!r:.120} |")
                continue
            error = max(max_relative_error(losses, references[model_name]) for losses in results)
            status = "ok" if error <= LOSS_RTOL else "OVER 1e-4"
            print(
                f"| {model_name} | {mesh} | {plan_dict['schedule']} | {plan_dict['virtual_stages']} | "
                f"{plan_dict['num_microbatches']} | {error:.1e} | {time.perf_counter() - started:.0f} s | "
                f"{status} |",
                flush=True,
            )
    finally:
        shutdown_rank_pool()


if __name__ == "__main__":
    main()
