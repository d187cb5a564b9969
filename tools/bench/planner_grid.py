"""The planner's step-time model against real training steps on CPU gloo ranks (issue #20).

    .venv/bin/python tools/bench/planner_grid.py                  # the whole grid, 5 timed steps each
    .venv/bin/python tools/bench/planner_grid.py --worlds 4 --steps 2
    .venv/bin/python tools/bench/planner_grid.py --profile-dir /tmp/profiles   # reuse calibrations

For each world size (4 and 8 ranks) the ``cpu`` profile is measured first (``calibrate_cpu``:
matmuls, fused attention, copies and per-op host costs timed on one core and scaled by the
slowdown the ranks bring each other running at once; gloo collectives on all ranks). Then, for
two Llama-shaped
``transformers`` models (float32), every grid configuration (dp / tp / pp / ZeRO / activation
checkpointing / micro-batch, forced through constraints) and the planner's own unconstrained
choice are planned with ``generate_plan(..., hardware=profile)`` and run for real through
``vescale.parallelize`` on the ranks, AdamW, one warm-up step and ``--steps`` (5) timed steps
(the median is the measurement). A choice that is one of the grid's configurations (every
section of the plan that decides what runs the same) is not run again: its row's measurement
stands, so the comparison is between configurations, not between two samples of one.
Printed: predicted vs measured step time per configuration, the Spearman rank correlation, the
share within +-20%, per (model, world) cell how the planner's choice compares with the fastest
measured configuration, the memory-tight cells of ``planner_tight_cells.py`` planned on the same
profiles (the choice against the rule-based one, by the model), and issue #20's goals, each
checked; ``--check`` exits 1 when one is missed.

The machine is shared: the ranks' timings include whatever else runs on it, and every run
prints the load average next to its table.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.planner import generate_plan
from vescale.planner.hardware import HardwareProfile, calibrate_cpu

SEQUENCE_LENGTH = 128
GLOBAL_BATCH = 8
MODELS = {
    "llama-s": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, vocab_size=1024),
    "llama-m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=2048),
}
# world size -> name -> constraints (fp32, the global batch and the sequence are added to each).
GRID: dict[int, dict[str, dict]] = {
    4: {
        "dp4 z0": {"data_parallel.size": 4, "zero.stage": 0},
        "dp4 z1": {"data_parallel.size": 4, "zero.stage": 1},
        "dp4 z3": {"data_parallel.size": 4, "zero.stage": 3},
        "dp4 z0 full": {"data_parallel.size": 4, "zero.stage": 0, "activation_checkpointing": "full"},
        "dp4 z0 mbs1": {"data_parallel.size": 4, "zero.stage": 0, "micro_batch_size": 1},
        "dp2 tp2": {"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 0},
        "tp4": {"tensor_parallel.size": 4, "data_parallel.size": 1},
        "pp2 dp2": {"pipeline_parallel.size": 2, "data_parallel.size": 2, "zero.stage": 0},
    },
    8: {
        "dp8 z0": {"data_parallel.size": 8, "zero.stage": 0},
        "dp8 z2": {"data_parallel.size": 8, "zero.stage": 2},
        "dp4 tp2": {"data_parallel.size": 4, "tensor_parallel.size": 2, "zero.stage": 1},
        "dp2 tp4": {"data_parallel.size": 2, "tensor_parallel.size": 4, "zero.stage": 0},
        "pp2 dp4": {"pipeline_parallel.size": 2, "data_parallel.size": 4, "zero.stage": 0},
        "pp2 dp2 tp2": {
            "pipeline_parallel.size": 2,
            "data_parallel.size": 2,
            "tensor_parallel.size": 2,
            "zero.stage": 1,
        },
    },
}


def _config(name: str) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        **MODELS[name],
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=SEQUENCE_LENGTH,
        use_cache=False,
        attn_implementation="sdpa",
    )


def _optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def measure_on_rank(model_name: str, plan_json: str, steps: int) -> list[float]:
    """Build the model deferred, parallelize it with the plan, time ``steps`` training steps."""
    vescale.manual_seed(0)
    model = vescale.deferred_init(transformers.LlamaForCausalLM, _config(model_name))
    plan = vescale.Plan.from_json(plan_json)
    model, optimizer, _, _ = vescale.parallelize(plan, model, _optimizer_fn)
    share = plan.global_batch_size // plan.mesh_size("dp")
    generator = torch.Generator().manual_seed(dist.get_rank())
    input_ids = torch.randint(
        0, MODELS[model_name]["vocab_size"], (share, SEQUENCE_LENGTH), generator=generator
    )
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        started = time.perf_counter()
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - started)
    return times[1:]


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    rx, ry = ranks(xs), ranks(ys)
    mean_x, mean_y = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mean_x) * (b - mean_y) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mean_x) ** 2 for a in rx) * sum((b - mean_y) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _profile(world: int, directory: Path | None) -> HardwareProfile:
    path = directory / f"cpu-{world}.json" if directory else None
    if path is not None and path.is_file():
        return HardwareProfile.from_dict(json.loads(path.read_text()))
    profile = calibrate_cpu(world)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_dict(), indent=2))
    return profile


def main() -> None:
    from bench_rows import bench_parser
    from planner_tight_cells import report_tight_cells, tight_cells

    parser = bench_parser(__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=sorted(GRID))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()
    rows, tight_rows = [], []
    for world in args.worlds:
        profile = _profile(world, args.profile_dir)
        print(f"cpu profile for {world} ranks: {json.dumps(profile.to_dict())}", flush=True)
        for model_name in args.models:
            with torch.device("meta"):
                meta_model = transformers.LlamaForCausalLM(_config(model_name))
            base = {
                "sequence_length": SEQUENCE_LENGTH,
                "global_batch_size": GLOBAL_BATCH,
                "memory_per_device_gb": 4.0,
            }
            tight_base = {k: v for k, v in base.items() if k != "memory_per_device_gb"}
            tight_base["mixed_precision"] = "fp32"
            tight_rows += tight_cells(meta_model, model_name, world, profile, tight_base)
            configs = {name: {**base, "mixed_precision": "fp32", **c} for name, c in GRID[world].items()}
            configs["planner's choice"] = {**base, "mixed_precision": "fp32"}
            measured_runs: dict[str, tuple[str, list]] = {}  # what runs -> (grid name, its times)
            for name, constraints in configs.items():
                plan = generate_plan(meta_model, constraints, world_size=world, hardware=profile)
                runs = _what_runs(plan)
                if runs in measured_runs:  # the planner chose a configuration of the grid
                    same, times = measured_runs[runs]
                    print(f"{world} ranks  {model_name:8s} {name:18s} is {same}: its measurement stands")
                else:
                    measured_times = _measure(world, model_name, name, plan, args.steps)
                    if measured_times is None:
                        continue
                    times = measured_times
                    measured_runs[runs] = (name, times)
                measured = statistics.median(max(rank[i] for rank in times) for i in range(args.steps))
                predicted = plan.performance.step_time_s
                rows.append((world, model_name, name, predicted, measured, plan))
                print(
                    f"{world} ranks  {model_name:8s} {name:18s} predicted {predicted:8.4f} s  measured "
                    f"{measured:8.4f} s  ratio {predicted / measured:5.2f}  load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        shutdown_rank_pool()
    met = _report(rows, report_tight_cells(tight_rows))
    if args.check and not met:
        raise SystemExit(1)


def _what_runs(plan: vescale.Plan) -> str:
    """The plan's sections that decide what runs (not its estimates or reasons), as JSON."""
    sections = json.loads(plan.to_json())
    return json.dumps({k: v for k, v in sections.items() if k not in ("memory", "performance", "reasons")})


def _measure(world: int, model_name: str, name: str, plan: vescale.Plan, steps: int) -> list | None:
    """Each rank's step times of ``plan``, or ``None`` (reported) where this torch cannot run it."""
    try:
        return run_on_ranks(measure_on_rank, world, (model_name, plan.to_json(), steps), timeout_s=900)
    except Exception as error:  # a plan this torch cannot run is reported, the grid goes on
        mesh = " ".join(f"{d}{s}" for d, s in plan.mesh if s > 1)
        print(
            f"{world} ranks  {model_name:8s} {name:18s} ({mesh}, "
            f"ZeRO-{plan.data_parallel.zero_stage}, {plan.activation_checkpointing}) failed: "
            f"{str(error).splitlines()[0]}"
        )
        return None


def _report(rows: list, tight_goals: list[tuple[str, bool]]) -> bool:
    from planner_tight_cells import rule_based_ratio

    grid = [row for row in rows if row[2] != "planner's choice"]
    predicted, measured = [r[3] for r in grid], [r[4] for r in grid]
    within = sum(abs(p / m - 1) <= 0.2 for p, m in zip(predicted, measured, strict=True))
    print("\n| ranks | model | configuration | predicted s | measured s | predicted / measured |")
    print("|---|---|---|---:|---:|---:|")
    for world, model_name, name, p, m, _ in rows:
        print(f"| {world} | {model_name} | {name} | {p:.4f} | {m:.4f} | {p / m:.2f} |")
    spearman = _spearman(predicted, measured)
    print(
        f"\nconfigurations: {len(grid)}; Spearman rank correlation {spearman:.3f}; "
        f"within +-20%: {within}/{len(grid)}"
    )
    speeds = []
    for world, model_name in sorted({(r[0], r[1]) for r in rows}):
        cell = [r for r in rows if (r[0], r[1]) == (world, model_name)]
        best = min(r[4] for r in cell)
        choice = next((r for r in cell if r[2] == "planner's choice"), None)
        if choice is None:
            print(f"{world} ranks {model_name}: the planner's choice did not run (see its line above)")
            speeds.append(0.0)
            continue
        speeds.append(best / choice[4])
        plan = choice[5]
        mesh = " ".join(f"{d}{s}" for d, s in plan.mesh if s > 1)
        print(
            f"{world} ranks {model_name}: planner's choice ({mesh}, ZeRO-{plan.data_parallel.zero_stage}, "
            f"{plan.activation_checkpointing}, mbs {plan.micro_batch_size}) measured {choice[4]:.4f} s = "
            f"{best / choice[4]:.0%} of the best measured speed"
        )
    goals = [
        ("at least 24 configurations", len(grid) >= 24),
        ("Spearman rank correlation >= 0.9", spearman >= 0.9),
        ("every prediction within +-20%", within == len(grid)),
        (
            "the choice >= 95% of the best in >= 80% of cells",
            sum(s >= 0.95 for s in speeds) >= 0.8 * len(speeds),
        ),
        ("the choice >= 90% of the best in every cell", all(s >= 0.9 for s in speeds)),
        (
            "grid cells: the choice never slower than the rules by the model",
            all(rule_based_ratio(r[5]) >= 1 - 1e-9 for r in rows if r[2] == "planner's choice"),
        ),
        *tight_goals,
    ]
    print("\n| goal (issue #20) | met |\n|---|---|")
    for goal, met in goals:
        print(f"| {goal} | {'yes' if met else 'NO'} |")
    return all(met for _, met in goals)


if __name__ == "__main__":
    main()
