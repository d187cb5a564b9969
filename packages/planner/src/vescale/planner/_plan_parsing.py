"""Reading a plan's JSON form back into the fields of :class:`~vescale.planner.plan.Plan`.

It depends on the plan's vocabulary (:mod:`vescale.planner._plan_format`), never on the
``Plan`` type itself, so the type's module can use it without an import cycle.

Every error names the field it is about (``pipeline_parallel.schedule``, ``mesh.tp``), so a user
who edited the JSON by hand knows what to fix.

Example::

    fields = plan_fields_from_dict(json.loads(text), TOP_LEVEL_KEYS)
    plan = Plan(**fields)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.doptim.plan import DataParallelPlan
from vescale.dpipe.plan import PipelinePlan
from vescale.planner._plan_format import PLAN_FORMAT, SECTION_ERRORS
from vescale.planner.errors import PlanError, PlanFormatError
from vescale.planner.memory import MemoryEstimate
from vescale.planner.performance import Performance

__all__ = ["plan_fields_from_dict"]

Section = TypeVar("Section")


def _section(name: str, parse: Callable[[Any], Section], value: Any) -> Section:
    try:
        return parse(value)
    except (*SECTION_ERRORS, PlanError, TypeError) as error:
        raise PlanFormatError(f"plan field {name}: {error}") from None


def _mapping(plan_dict: Any, name: str, keys: Sequence[str], required: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(plan_dict, dict):
        raise PlanFormatError(f"plan field {name} must be a JSON object with the keys {list(keys)}")
    for key in plan_dict:
        if key not in keys:
            close = difflib.get_close_matches(str(key), keys, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the keys are {list(keys)}"
            where = f"{name}.{key}" if name != "plan" else key
            raise PlanFormatError(f"unknown plan field {where!r}; {hint}")
    for key in required:
        if key not in plan_dict:
            where = f"{name}.{key}" if name != "plan" else key
            raise PlanFormatError(f"plan field {where!r} is missing")
    return plan_dict


def plan_fields_from_dict(plan_dict: Any, top_level_keys: Sequence[str]) -> dict[str, Any]:
    """The keyword arguments of ``Plan`` for its JSON form (``Plan.to_dict``'s output).

    Example::

        Plan(**plan_fields_from_dict(plan.to_dict(), TOP_LEVEL_KEYS))
    """
    top = _mapping(plan_dict, "plan", top_level_keys, required=("mesh", "data_parallel", "micro_batching"))
    if top.get("format", PLAN_FORMAT) != PLAN_FORMAT:
        raise PlanFormatError(f"plan field format={top['format']!r}: this version reads {PLAN_FORMAT!r}")
    tensor_parallel = _mapping(
        top.get("tensor_parallel") or {}, "tensor_parallel", ("sequence_parallel", "sharding_plan")
    )
    batching = _mapping(
        top["micro_batching"],
        "micro_batching",
        ("global_batch_size", "micro_batch_size", "sequence_length"),
        required=("global_batch_size",),
    )
    # Plans written before the expert-parallel section read as ep=1 plans without one.
    experts = _mapping(
        top.get("expert_parallel") or {}, "expert_parallel", ("expert_tensor_parallel", "capacity_factor")
    )
    memory = _mapping(top.get("memory") or {}, "memory", ("memory_per_device_gb", "estimate"))
    reasons = top.get("reasons") or {}
    if not isinstance(reasons, dict) or not all(isinstance(v, str) for v in reasons.values()):
        raise PlanFormatError("plan field reasons must be a JSON object of choice -> reason text")
    if not isinstance(top["mesh"], dict):
        raise PlanFormatError('plan field mesh must be a JSON object like {"dp": 2, "tp": 2}')
    sharding = tensor_parallel.get("sharding_plan")
    pipeline = top.get("pipeline_parallel")
    estimate = memory.get("estimate")
    performance = top.get("performance")
    fields = {
        "mesh": top["mesh"],
        "data_parallel": _section("data_parallel", DataParallelPlan.from_dict, top["data_parallel"]),
        "sharding_plan": None
        if sharding is None
        else _section("tensor_parallel.sharding_plan", ShardingPlan.from_dict, sharding),
        "sequence_parallel": tensor_parallel.get("sequence_parallel", False),
        "pipeline": None
        if pipeline is None
        else _section("pipeline_parallel", PipelinePlan.from_dict, pipeline),
        "expert_tensor_parallel": experts.get("expert_tensor_parallel"),
        "capacity_factor": experts.get("capacity_factor"),
        "activation_checkpointing": top.get("activation_checkpointing", "none"),
        "memory_per_device_gb": memory.get("memory_per_device_gb"),
        "memory_estimate": None
        if estimate is None
        else _section("memory.estimate", MemoryEstimate.from_dict, estimate),
        "reasons": tuple(reasons.items()),
        "performance": None
        if performance is None
        else _section("performance", Performance.from_dict, performance),
    }
    fields.update(batching)
    return fields
