"""The doptim acceptance table: parameters after 10 AdamW steps against single-device training.

Runs the rank functions the tests assert with (loaded from the test files, so the table and
the tests cannot drift apart) and prints one markdown row per case: the worst parameter's max
abs error and relative error (``max |parallel - reference| / max |reference|``, worst over
parameters and ranks) and whether the case meets its bound:

* fp32, AdamW with clipping, same global batch: dp 2 and 4 x ZeRO 0-3, and dp2 x tp2 (tiny
  ``transformers`` Llama, with and without sequence parallelism) x ZeRO 0-3; bound 1e-5 relative;
* deterministic mode against the single-device gradient-accumulation reference, dp 2 and 4 x
  ZeRO 0-3; bound: bitwise;
* ZeRO-3 bf16 compute with fp32 masters against the single-process bf16 recipe, deterministic
  (bitwise) and default with clipping (1e-5 relative).

    .venv/bin/python tools/doptim_accuracy.py            # every case (several minutes on 2 cores)
    .venv/bin/python tools/doptim_accuracy.py dp_tp bf16  # only these groups (fp32 dp_tp deterministic bf16)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("fp32", "dp_tp", "deterministic", "bf16")


def _test_module(relative_path: str) -> ModuleType:
    """A test file as a module, registered under its file name (rank processes load it by path)."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _errors(
    results: list[dict[str, torch.Tensor]], reference: dict[str, torch.Tensor]
) -> tuple[float, float, bool]:
    worst_abs = worst_relative = 0.0
    bitwise = True
    for params in results:
        for name, expected in reference.items():
            max_abs = (params[name] - expected).abs().max().item()
            worst_abs = max(worst_abs, max_abs)
            worst_relative = max(worst_relative, max_abs / expected.abs().max().item())
            bitwise = bitwise and torch.equal(params[name], expected)
    return worst_abs, worst_relative, bitwise


def _row(case: str, errors: tuple[float, float, bool], bound: str) -> None:
    max_abs, relative, bitwise = errors
    within = bitwise if bound == "bitwise" else relative <= 1e-5
    print(
        f"| {case} | {max_abs:.2e} | {relative:.2e} | {'yes' if bitwise else 'no'} | {bound} | "
        f"{'ok' if within else 'FAILED'} |"
    )


def main() -> None:
    wanted = set(sys.argv[1:]) or set(GROUPS)
    print("| case | max abs error | relative error | bitwise | bound | status |")
    print("|---|---:|---:|---|---|---|")
    try:
        if "fp32" in wanted:
            training = _test_module("packages/doptim/tests/test_doptim_training.py")
            reference = training.reference_training()[0]
            for dp_size in (2, 4):
                for zero_stage in (0, 1, 2, 3):
                    results = run_on_ranks(training.parallel_training, world_size=dp_size, args=(zero_stage,))
                    errors = _errors([params for params, _ in results], reference)
                    _row(f"fp32 dp{dp_size} ZeRO-{zero_stage}", errors, "1e-5 relative")
        if "dp_tp" in wanted:
            dp_tp = _test_module("packages/vescale/tests/test_vescale_dp_tp.py")
            reference = dp_tp.reference_training()[0]
            for sequence_parallel in (False, True):
                for zero_stage in (0, 1, 2, 3):
                    results = run_on_ranks(
                        dp_tp.dp_tp_training,
                        world_size=4,
                        args=(zero_stage, sequence_parallel),
                        timeout_s=600,
                    )
                    errors = _errors([params for params, _ in results], reference)
                    name = "tp+sp" if sequence_parallel else "tp"
                    _row(f"fp32 dp2 x tp2 ({name}) Llama ZeRO-{zero_stage}", errors, "1e-5 relative")
        if "deterministic" in wanted:
            deterministic = _test_module("packages/doptim/tests/test_doptim_deterministic.py")
            for dp_size in (2, 4):
                reference = deterministic.accumulation_reference(dp_size)
                results = run_on_ranks(deterministic.deterministic_training_all_stages, world_size=dp_size)
                for zero_stage in (0, 1, 2, 3):
                    errors = _errors([per_stage[zero_stage] for per_stage in results], reference)
                    _row(f"deterministic dp{dp_size} ZeRO-{zero_stage}", errors, "bitwise")
        if "bf16" in wanted:
            mixed = _test_module("packages/doptim/tests/test_doptim_mixed_precision.py")
            for dp_size in (2, 4):
                results = run_on_ranks(mixed.both_modes, world_size=dp_size)
                bitwise_reference = mixed.bf16_recipe(dp_size, clip=False)
                clipped_reference = mixed.bf16_recipe(dp_size, clip=True)
                errors = _errors([run["params"] for run, _ in results], bitwise_reference)
                _row(f"bf16 ZeRO-3 deterministic dp{dp_size}", errors, "bitwise")
                errors = _errors([run["params"] for _, run in results], clipped_reference)
                _row(f"bf16 ZeRO-3 default + clipping dp{dp_size}", errors, "1e-5 relative")
    finally:
        shutdown_rank_pool()


if __name__ == "__main__":
    main()
