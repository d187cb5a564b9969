"""``generate_plan`` with a hardware profile: the fastest predicted plan, its performance section,
the runners-up and the rule-based choice's predicted time beside it.

Example::

    cluster = Cluster(h100, world_size=1024, per_node=8, budget_gib=80.0)
    plan = plan_by_cost(model, profile, constraints, cluster, auto=auto, reasons={}, top_k=5)
"""

from __future__ import annotations

from torch import nn

from vescale.dmodule.auto_plan import AutoShardingResult
from vescale.planner._assembly import assemble_plan
from vescale.planner._profile_scaling import scaled_profile
from vescale.planner.constraints import Constraints
from vescale.planner.cost import predict_step
from vescale.planner.errors import PlanError
from vescale.planner.hardware import HardwareProfile
from vescale.planner.memory import ParallelChoices
from vescale.planner.performance import Performance, RunnerUp
from vescale.planner.plan import Plan
from vescale.planner.profile import ModelProfile
from vescale.planner.search import Candidate, Cluster, search_plans, seconds_per_sample

__all__ = ["performance_of", "plan_by_cost"]


def performance_of(
    candidate: Candidate, hardware: HardwareProfile, world_size: int, runners_up: tuple[RunnerUp, ...] = ()
) -> Performance:
    """The plan's ``"performance"`` section for a costed candidate.

    Example::

        performance_of(ranked[0], h100, world_size=64).mfu
    """
    c, cost = candidate.choices, candidate.cost
    batch_ranks = c.data_parallel_size * c.expert_parallel_size
    tokens = c.num_microbatches * c.micro_batch_size * batch_ranks * c.sequence_length
    per_device = cost.model_flops / cost.step_time_s / world_size
    return Performance(
        hardware=hardware.name,
        step_time_s=cost.step_time_s,
        tokens_per_s=tokens / cost.step_time_s,
        model_tflops_per_device=per_device / 1e12,
        mfu=per_device / hardware.peak_flops(c.mixed_precision),
        breakdown=cost.breakdown,
        runners_up=runners_up,
    )


def _why_lost(best: Candidate, other: Candidate) -> str:
    slower = seconds_per_sample(other) / seconds_per_sample(best) - 1
    mine, theirs = dict(best.cost.breakdown), dict(other.cost.breakdown)
    part = max(theirs, key=lambda name: theirs[name] - mine.get(name, 0.0))
    grew = theirs[part] - mine.get(part, 0.0)
    if slower <= 1e-9:
        return "as fast; ranked after it by memory and then its fields (deterministic ties)"
    return f"{100 * slower:.1f}% slower per sample, most of it in {part} (+{grew:.3g} s)"


def _runners_up(ranked: list[Candidate], top_k: int) -> tuple[RunnerUp, ...]:
    seen = {ranked[0].describe()}
    result: list[RunnerUp] = []
    for candidate in ranked[1:]:
        if len(result) >= top_k:
            break
        text = candidate.describe()
        if text in seen:
            continue
        seen.add(text)
        result.append(
            RunnerUp(
                text, candidate.cost.step_time_s, candidate.cost.breakdown, _why_lost(ranked[0], candidate)
            )
        )
    return tuple(result)


def _split_points(split: tuple[int, ...], profile: ModelProfile, pp: int) -> tuple[str, ...]:
    """Module FQNs that start each stage, or ``()`` when the split is the uniform one."""
    per_stage = -(-profile.num_blocks // pp)
    if not split or split == tuple(per_stage * s for s in range(1, pp)):
        return ()
    return tuple(f"{profile.blocks_fqn}.{block}" for block in split)


def plan_by_cost(
    model: nn.Module,
    profile: ModelProfile,
    constraints: Constraints,
    cluster: Cluster,
    *,
    auto: AutoShardingResult | None,
    reasons: dict[str, str],
    top_k: int = 5,
    rule_choice: ParallelChoices | None = None,
    expert_sizes: tuple[int, ...] = (1,),
) -> Plan:
    """The fastest predicted plan (:mod:`vescale.planner.search`) as a :class:`Plan` with its
    ``performance`` section; ``rule_choice`` (the rule-based planner's choice) is costed too and
    reported in the reasons; ``expert_sizes`` are the ep sizes to search (a model with MoE blocks).

    Example::

        cluster = Cluster(h100, world_size=8, per_node=8, budget_gib=80.0)
        plan = plan_by_cost(model, profile, Constraints(), cluster, auto=auto, reasons={})
    """
    hardware, world_size, per_node = cluster.hardware, cluster.world_size, cluster.per_node
    if auto is None and constraints.tensor_parallel_size not in (None, 1) and world_size > 1:
        raise PlanError("tensor parallelism was asked for but the model could not be analysed")
    ranked = search_plans(
        profile,
        constraints,
        cluster,
        sharding_plans={False: auto.plan, True: auto.plan} if auto else {},
        head_counts=auto.head_counts if auto else (),
        sequence_length=profile.sequence_length,
        expert_sizes=expert_sizes,
    )
    best = ranked[0]
    c = best.choices
    fastest = (
        f"fastest predicted of {len(ranked)} plans that fit ({best.cost.step_time_s:.4g} s per step on "
        f"{hardware.name}; runners-up in explain())"
    )
    searched = {
        "tensor_parallel": "tensor_parallel_size",
        "pipeline_parallel": "pipeline_parallel_size",
        "data_parallel": "data_parallel_size",
        "expert_parallel": "expert_parallel_size",
        "zero_stage": "zero_stage",
        "activation_checkpointing": "activation_checkpointing",
        "mixed_precision": "mixed_precision",
    }
    for choice, field_name in searched.items():
        if getattr(constraints, field_name) is None:
            reasons[choice] = fastest
    if rule_choice is not None:
        from_rules = predict_step(
            scaled_profile(profile, rule_choice.micro_batch_size),
            rule_choice,
            hardware,
            devices_per_node=per_node,
        )
        samples = (
            rule_choice.data_parallel_size
            * rule_choice.expert_parallel_size
            * rule_choice.micro_batch_size
            * rule_choice.num_microbatches
        )
        ratio = from_rules.step_time_s / samples / seconds_per_sample(best)
        reasons["rule_based_choice"] = (
            f"tp={rule_choice.tensor_parallel_size} pp={rule_choice.pipeline_parallel_size} dp="
            f"{rule_choice.data_parallel_size} ep={rule_choice.expert_parallel_size} "
            f"ZeRO-{rule_choice.zero_stage} {rule_choice.mixed_precision} "
            f"{rule_choice.activation_checkpointing!r}: predicted {from_rules.step_time_s:.4g} s, "
            f"{ratio:.2f}x the chosen plan's time per sample"
        )
    performance = performance_of(best, hardware, world_size, _runners_up(ranked, top_k))
    return assemble_plan(
        model,
        auto,
        constraints,
        c,
        best.memory,
        cluster.budget_gib,
        reasons,
        per_node,
        virtual_stages=best.virtual_stages,
        split_points=_split_points(best.stage_split, profile, c.pipeline_parallel_size),
        performance=performance,
    )
