"""``vescale plan``: the plan and memory estimate for a model on N devices, on meta tensors only.

Example::

    vescale plan --model llama-3-70b --world-size 1024 --constraints '{"mixed_precision": "bf16"}'
    vescale plan --model tiny-llama --world-size 4 --json plan.json
"""

from __future__ import annotations

import time
from pathlib import Path

from vescale.cli.constraints_input import parse_constraints
from vescale.cli.errors import CLIUsageError
from vescale.cli.models import resolve_model

__all__ = ["plan_command"]


def plan_command(
    model: str, world_size: int, constraints: str | None, json_path: Path | None, explain: bool
) -> None:
    """Build ``model`` on the meta device, plan it for ``world_size`` devices, print (and write) the plan.

    Example::

        plan_command("tiny-llama", 4, None, Path("plan.json"), explain=True)
    """
    if world_size < 1:
        raise CLIUsageError(f"--world-size {world_size} must be at least 1")
    constraint_dict = parse_constraints(constraints)
    started = time.perf_counter()
    import torch

    from vescale.planner import Constraints, generate_plan

    # Refuse impossible constraints before building the model (transformers' import takes seconds).
    Constraints.from_dict(constraint_dict).check_world_size(world_size)
    source = resolve_model(model)

    # Meta tensors: a 70B-parameter model costs no memory and seconds to plan.
    with torch.device("meta"):
        module = source.build()
    plan = generate_plan(module, constraint_dict, world_size=world_size)
    elapsed = time.perf_counter() - started
    parameters = sum(parameter.numel() for parameter in module.parameters())
    print(f"model {source.name}: {type(module).__name__}, {parameters / 1e6:,.1f}M parameters")
    print(plan)
    if explain:
        print("why")
        print("-" * 40)
        print("\n".join(f"  {line}" for line in plan.explain().splitlines()))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(plan.to_json() + "\n")
        print(f"plan written to {json_path} (vescale.Plan.from_json reads it back, edited or not)")
    print(f"planned in {elapsed:.1f} s")
