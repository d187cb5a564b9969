"""Turning the planner's choices into a :class:`~vescale.planner.plan.Plan`: every section built
by the package that owns it, and the reason for each choice.

Example::

    plan = assemble_plan(model, auto, constraints, choices, estimate, budget, reasons, per_node)
"""

from __future__ import annotations

from torch import nn

from vescale.dmodule.auto_plan import AutoShardingResult, plan_tensor_parallel
from vescale.doptim.plan import DataParallelPlan
from vescale.dpipe.plan import PipelinePlan
from vescale.planner._meta_forward import meta_parameters
from vescale.planner._plan_reasons import explain_choices
from vescale.planner.constraints import Constraints
from vescale.planner.errors import PlanError
from vescale.planner.memory import MemoryEstimate, ParallelChoices
from vescale.planner.performance import Performance
from vescale.planner.plan import Plan

__all__ = ["assemble_plan"]


def assemble_plan(
    model: nn.Module,
    auto: AutoShardingResult | None,
    constraints: Constraints,
    choices: ParallelChoices,
    estimate: MemoryEstimate,
    budget: float,
    reasons: dict[str, str],
    per_node: int,
    *,
    virtual_stages: int = 1,
    split_points: tuple[str, ...] = (),
    performance: Performance | None = None,
) -> Plan:
    """The :class:`Plan` of ``choices``: the sharding plan (redone with sequence parallelism when
    on), the pipeline section (``split_points`` cut a non-uniform split), the reasons.

    Example::

        plan = assemble_plan(model, auto, constraints, choices, estimate, 80.0, {}, 8)
    """
    tp, pp, ep = choices.tensor_parallel_size, choices.pipeline_parallel_size, choices.expert_parallel_size
    sharding_plan = None
    if tp > 1:
        # The analysis ran without sequence parallelism; with it the forward placements differ.
        sp = choices.sequence_parallel
        if sp:
            with meta_parameters(model):
                sharding_plan = plan_tensor_parallel(model, sequence_parallel=True).plan
        elif auto is None:
            raise PlanError(
                f"tensor_parallel_size={tp} needs the automatic sharding analysis of the model; "
                "pass the AutoShardingResult of plan_tensor_parallel(model)"
            )
        else:
            sharding_plan = auto.plan
    pipeline = None
    if pp > 1:
        pipeline = PipelinePlan(
            size=pp,
            split_method=constraints.pipeline_parallel_split_method
            or ("manual" if constraints.pipeline_parallel_split_points or split_points else "uniform"),
            split_points=constraints.pipeline_parallel_split_points or split_points,
            schedule=choices.schedule,
            num_microbatches=choices.num_microbatches,
            virtual_stages=virtual_stages,
        )
    # The caller's reasons win (the search explains its choices itself); the rest say why they hold.
    reasons = dict(reasons)
    for choice, reason in explain_choices(constraints, choices, estimate, budget, per_node).items():
        reasons.setdefault(choice, reason)
    return Plan(
        mesh=(("pp", pp), ("dp", choices.data_parallel_size), ("ep", ep), ("tp", tp)),
        data_parallel=DataParallelPlan(
            size=choices.data_parallel_size,
            zero_stage=choices.zero_stage,
            mixed_precision=choices.mixed_precision,
            deterministic=bool(constraints.data_parallel_deterministic),
        ),
        global_batch_size=choices.num_microbatches
        * choices.data_parallel_size
        * ep
        * choices.micro_batch_size,
        micro_batch_size=choices.micro_batch_size,
        sequence_length=choices.sequence_length,
        sharding_plan=sharding_plan,
        sequence_parallel=choices.sequence_parallel,
        pipeline=pipeline,
        activation_checkpointing=choices.activation_checkpointing,
        memory_per_device_gb=float(budget),
        memory_estimate=estimate,
        reasons=tuple(reasons.items()),
        performance=performance,
        expert_tensor_parallel=constraints.expert_tensor_parallel,
        capacity_factor=constraints.expert_parallel_capacity_factor,
    )
