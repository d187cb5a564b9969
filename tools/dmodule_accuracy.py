"""The dmodule accuracy table: automatic TP/SP plans against the single-process model.

Runs the very cases of ``packages/dmodule/tests/test_dmodule_auto_plan.py`` (its rank
function and its case list, so the table and the test measure the same thing) and prints,
per model x mesh x sequence parallelism: the loss error, the worst gradient error (and
which parameter), the worst loss error over 20 AdamW steps, and whether all are within the
test's tolerances. Errors are GUIDE's relative errors, worst over the ranks.

    .venv/bin/python tools/dmodule_accuracy.py            # every case (a few minutes)
    .venv/bin/python tools/dmodule_accuracy.py llama gpt2 # only these models
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool

TEST_FILE = Path(__file__).resolve().parent.parent / "packages/dmodule/tests/test_dmodule_auto_plan.py"


def _load_test_module():
    spec = importlib.util.spec_from_file_location(TEST_FILE.stem, TEST_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[TEST_FILE.stem] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    tests = _load_test_module()
    wanted = set(sys.argv[1:])
    print("| model | mesh | SP | loss error | max gradient error (parameter) | 20-step max loss | status |")
    print("|---|---|---|---|---|---|---|")
    for case in tests.TRAINING_CASES:
        name, mesh_dims, sequence_parallel = case.values
        if wanted and name not in wanted:
            continue
        world_size = 1
        for size in mesh_dims.values():
            world_size *= size
        results = run_on_ranks(
            tests.auto_plan_training_errors,
            world_size=world_size,
            args=(name, mesh_dims, sequence_parallel, 20),
        )
        loss_error = max(result["loss_error"] for result in results)
        grad_error, parameter = max(
            (error, fqn) for result in results for fqn, error in result["grad_errors"].items()
        )
        step_error = max(max(result["step_loss_errors"]) for result in results)
        within = (
            loss_error <= tests.LOSS_RTOL
            and grad_error <= tests.GRAD_RTOL
            and step_error <= tests.STEP_LOSS_RTOL
        )
        mesh = "x".join(f"{dim}{size}" for dim, size in mesh_dims.items())
        print(
            f"| {name} | {mesh} | {'on' if sequence_parallel else 'off'} | {loss_error:.1e} | "
            f"{grad_error:.1e} ({parameter}) | {step_error:.1e} | {'ok' if within else 'FAIL'} |"
        )
    shutdown_rank_pool()


if __name__ == "__main__":
    main()
