"""``vescale plan``: the plan, memory estimate and predicted speed for a model on N devices, on meta
tensors only.

Example::

    vescale plan --model llama-3-70b --hardware h100-80gb --nodes 128 --top 3
    vescale plan --model tiny-llama --world-size 4 --calibrate --json plan.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vescale.cli.constraints_input import parse_constraints
from vescale.cli.errors import CLIUsageError
from vescale.cli.models import resolve_model

__all__ = ["plan_command"]

_DEFAULT_WORLD_SIZE = 8


def _world_size(world_size: int | None, nodes: int | None, per_node: int | None) -> int:
    if nodes is None:
        return _DEFAULT_WORLD_SIZE if world_size is None else world_size
    if nodes < 1:
        raise CLIUsageError(f"--nodes {nodes} must be at least 1")
    if per_node is None:
        raise CLIUsageError(
            "--nodes needs the devices per node: give --hardware (its profile says) or the "
            "devices_per_node constraint"
        )
    if world_size is not None and world_size != nodes * per_node:
        raise CLIUsageError(
            f"--world-size {world_size} differs from --nodes {nodes} x {per_node} devices per node; give one"
        )
    return nodes * per_node


def plan_command(
    model: str,
    world_size: int | None,
    constraints: str | None,
    json_path: Path | None,
    explain: bool,
    *,
    hardware: str | None = None,
    nodes: int | None = None,
    top: int = 3,
    calibrate: bool = False,
    profile_out: Path = Path("vescale-cpu-profile.json"),
) -> None:
    """Build ``model`` on the meta device, plan it, print (and write) the plan.

    Example::

        plan_command("llama-3-70b", None, None, None, explain=True, hardware="h100-80gb", nodes=128)
    """
    if world_size is not None and world_size < 1:
        raise CLIUsageError(f"--world-size {world_size} must be at least 1")
    if top < 0:
        raise CLIUsageError(f"--top {top} must be 0 or more")
    if calibrate and hardware is not None:
        raise CLIUsageError("--calibrate measures this machine's cpu profile; drop --hardware or --calibrate")
    constraint_dict = parse_constraints(constraints)
    started = time.perf_counter()
    import torch

    from vescale.planner import Constraints, generate_plan
    from vescale.planner.hardware import calibrate_cpu, load_hardware

    parsed = Constraints.from_dict(constraint_dict)
    hardware = hardware or parsed.hardware
    profile = None
    if calibrate:
        ranks = min(world_size or _DEFAULT_WORLD_SIZE, 8)
        profile = calibrate_cpu(ranks)
        profile_out.parent.mkdir(parents=True, exist_ok=True)
        profile_out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
        print(f"cpu profile measured on {ranks} ranks, written to {profile_out} (--hardware {profile_out})")
    elif hardware is not None:
        profile = load_hardware(hardware)
    per_node = parsed.devices_per_node or (profile.devices_per_node if profile else None)
    world_size = _world_size(world_size, nodes, per_node)
    # Refuse impossible constraints before building the model (transformers' import takes seconds).
    parsed.check_world_size(world_size)
    source = resolve_model(model)

    # Meta tensors: a 70B-parameter model costs no memory and seconds to plan.
    with torch.device("meta"):
        module = source.build()
    plan = generate_plan(module, constraint_dict, world_size=world_size, hardware=profile, top_k=top)
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
