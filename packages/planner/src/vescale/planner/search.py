"""The cost-model search: the fastest predicted plan whose predicted memory fits, with a margin.

Over ``(tp, pp, dp)`` (:func:`~vescale.planner._parallel_sizes.parallel_sizes`), mixed
precision, ZeRO stage, activation checkpointing, micro-batch size (the divisors of a dp rank's
share of ``global_batch_size``, when one is given), and for ``pp > 1`` the schedule (GPipe,
1F1B, interleaved 1F1B with 2 or 4 virtual stages, zero-bubble) — each constraint replaces its
axis by its one value; sequence parallelism is on with ``tp > 1`` unless constrained (it moves
the same ring volume and divides the norms). Memory first: a candidate is costed only when its
estimate (:mod:`vescale.planner.memory`, activations scaled linearly from one profiled
micro-batch) is at most ``(1 - margin)`` of the budget. Pipeline stage boundaries come from a
partition that minimises the slowest stage's time. Candidates are ranked by seconds per sample
(the step time when ``global_batch_size`` is given). Ties are broken by memory, then
by the candidate's fields, so the answer is the same on every run. For a model with MoE blocks
the expert-parallel sizes given (``expert_sizes``) are one more axis: ``ep`` takes its share of
the world from ``dp`` and the batch is split over ``dp x ep``; its memory is estimated directly
(the cache below divides by dp alone) and its all-to-alls are priced by the step-time model.

Example::

    cluster = Cluster(load_hardware("h100-80gb"), world_size=64, per_node=8, budget_gib=80.0)
    ranked = search_plans(profile, constraints, cluster, sharding_plans=plans, head_counts=(32, 8))
    best = ranked[0]
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, TypeVar

from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.planner._parallel_sizes import candidate_layout, divisors, parallel_sizes
from vescale.planner._profile_scaling import scaled_profile
from vescale.planner.constraints import Constraints
from vescale.planner.cost import StepCost, balanced_split, op_parts, predict_step
from vescale.planner.errors import ConstraintError
from vescale.planner.hardware import HardwareProfile
from vescale.planner.memory import (
    MemoryEstimate,
    ParallelChoices,
    estimate_from_profile,
    peak_of_stages,
    publishes_in_place,
    stage_sizes,
)
from vescale.planner.profile import ModelProfile

__all__ = ["MEMORY_MARGIN", "Candidate", "Cluster", "search_plans", "seconds_per_sample"]

MEMORY_MARGIN = 0.05
"""The share of the memory budget a chosen plan leaves free (allocator caching, fragmentation)."""
_GIB = 2**30
_MAX_MICRO_BATCH = 16


@dataclass(frozen=True)
class Candidate:
    """One costed plan: its choices, virtual stages, stage split, memory and predicted step."""

    choices: ParallelChoices
    virtual_stages: int
    stage_split: tuple[int, ...]
    memory: MemoryEstimate
    cost: StepCost

    def describe(self) -> str:
        """A one-line summary, e.g. ``"pp1 dp8 tp1 zero3 bf16 mbs2 ac=selective"``."""
        c = self.choices
        experts = f" ep{c.expert_parallel_size}" if c.expert_parallel_size > 1 else ""
        text = (
            f"pp{c.pipeline_parallel_size} dp{c.data_parallel_size}{experts} tp{c.tensor_parallel_size}"
            f"{' sp' if c.sequence_parallel else ''} zero{c.zero_stage} {c.mixed_precision} "
            f"mbs{c.micro_batch_size} ac={c.activation_checkpointing}"
        )
        if c.pipeline_parallel_size > 1:
            text += f" {c.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return text


_T = TypeVar("_T")


def _axis(value: _T | None, default: list[_T]) -> list[_T]:
    return [value] if value is not None else default


def _micro_batches(constraints: Constraints, dp: int, pp: int) -> list[tuple[int, int]]:
    """``(micro_batch_size, num_microbatches)`` pairs a dp rank can run."""
    if constraints.global_batch_size is None:
        micro = constraints.micro_batch_size or 1
        return [(micro, constraints.pipeline_parallel_num_microbatches or pp)]
    share, rest = divmod(constraints.global_batch_size, dp)
    if rest:
        return []
    pairs = []
    for micro in _axis(constraints.micro_batch_size, [d for d in divisors(share) if d <= _MAX_MICRO_BATCH]):
        count = share // micro
        if share % micro or count < 1:
            continue
        if constraints.pipeline_parallel_num_microbatches not in (None, count):
            continue
        pairs.append((micro, count))
    return pairs


def _schedules(constraints: Constraints, pp: int, microbatches: int, blocks: int) -> list[tuple[str, int]]:
    """The (schedule, virtual stages) pairs to cost. ZBV is costed only where the constraints name it."""
    if pp == 1:
        return [("1f1b", 1)]
    names = _axis(
        constraints.pipeline_parallel_schedule, ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
    )
    wanted = constraints.pipeline_parallel_virtual_stages
    options = []
    for name in names:
        if name == "interleaved_1f1b":
            virtuals = [wanted] if wanted is not None else [2, 4]
            options += [(name, v) for v in virtuals if blocks % (pp * v) == 0 and microbatches % pp == 0]
        elif name == "zbv":
            options += [(name, 2)] if blocks % (pp * 2) == 0 else []
        elif name == "1f1b" and microbatches < pp and constraints.pipeline_parallel_schedule is None:
            continue
        elif name == "zero_bubble" and wanted is not None:
            options += [(name, wanted)] if blocks % (pp * wanted) == 0 else []
        else:
            options.append((name, 1))
    return [(name, v) for name, v in options if wanted is None or v == wanted]


def _in_flight(choices: ParallelChoices) -> int:
    if choices.pipeline_parallel_size == 1:
        return 1
    if choices.schedule == "gpipe":
        return choices.num_microbatches
    return min(choices.num_microbatches, choices.pipeline_parallel_size)


class _MemoryCache:
    """Stage sizes per memory-relevant key, with ZeRO's division of the optimizer state applied after."""

    def __init__(self, publish_in_place: bool) -> None:
        self.sizes: dict[tuple[Any, ...], list[Any]] = {}
        self.publish_in_place = publish_in_place

    def estimate(self, profile: ModelProfile, choices: ParallelChoices) -> MemoryEstimate:
        if choices.expert_parallel_size > 1:  # ZeRO divides experts and the rest differently
            return estimate_from_profile(profile, choices, publish_in_place=self.publish_in_place)
        key = (
            id(profile),
            choices.tensor_parallel_size,
            choices.pipeline_parallel_size,
            choices.sequence_parallel,
            choices.mixed_precision,
            choices.activation_checkpointing,
            # What a stage's activations depend on: the micro-batches in flight (memory.py).
            _in_flight(choices),
        )
        if key not in self.sizes:
            base = dataclasses.replace(choices, data_parallel_size=1, zero_stage=0)
            self.sizes[key] = stage_sizes(profile, base)
        dp, stages = choices.data_parallel_size, self.sizes[key]
        if choices.zero_stage >= 1:
            stages = [dataclasses.replace(s, optimizer_states=s.optimizer_states / dp) for s in stages]
        return peak_of_stages(
            [(sizes, dp) for sizes in stages], choices, publish_in_place=self.publish_in_place
        )


@dataclass(frozen=True)
class Cluster:
    """The devices a plan is searched for: ``world_size`` of them, ``per_node`` to a node, each
    with ``budget_gib`` of memory and priced by ``hardware``.

    Example::

        cluster = Cluster(load_hardware("h100-80gb"), world_size=64, per_node=8, budget_gib=80.0)
    """

    hardware: HardwareProfile
    world_size: int
    per_node: int
    budget_gib: float


def search_plans(
    profile: ModelProfile,
    constraints: Constraints,
    cluster: Cluster,
    *,
    sharding_plans: dict[bool, ShardingPlan | None],
    head_counts: tuple[int, ...],
    sequence_length: int,
    margin: float = MEMORY_MARGIN,
    expert_sizes: tuple[int, ...] = (1,),
) -> list[Candidate]:
    """Every fitting candidate, fastest first (module docstring); ``sharding_plans[sp]`` is the
    tensor-parallel plan with or without sequence parallelism. Raises ``ConstraintError`` when
    nothing fits.

    Example::

        best = search_plans(profile, Constraints(), Cluster(h100, world_size=8, per_node=8, budget_gib=80),
                            sharding_plans={False: p, True: p_sp}, head_counts=(32,),
                            sequence_length=8192)[0]
    """
    hardware, per_node, budget_gib = cluster.hardware, cluster.per_node, cluster.budget_gib
    sizes = _sizes_with_experts(cluster.world_size, constraints, per_node, head_counts, profile, expert_sizes)
    memory = _MemoryCache(publish_in_place=publishes_in_place(hardware.name))
    scaled, ranked, smallest = {}, [], None
    parts_cache: dict[tuple[Any, ...], dict[int | str, Any]] = {}
    splits: dict[tuple[Any, ...], tuple[int, ...]] = {}
    limit = budget_gib * _GIB * (1 - margin)
    precisions = _axis(constraints.mixed_precision, ["bf16", "fp32"])
    recomputes = _axis(constraints.activation_checkpointing, ["none", "selective", "full"])
    for (tp, pp, dp, ep), precision, zero, recompute in itertools.product(
        sizes, precisions, _axis(constraints.zero_stage, [0, 1, 2, 3]), recomputes
    ):
        layout = candidate_layout(
            constraints, (tp, pp, dp, ep), zero, recompute, precision, sequence_length, sharding_plans
        )
        if layout is None:
            continue
        for micro, count in _micro_batches(constraints, dp * ep, pp):
            if micro not in scaled:
                scaled[micro] = scaled_profile(profile, micro)
            for schedule, virtual in _schedules(constraints, pp, count, profile.num_blocks):
                choices = dataclasses.replace(
                    layout, micro_batch_size=micro, num_microbatches=count, schedule=schedule
                )
                estimate = memory.estimate(scaled[micro], choices)
                if smallest is None or estimate.total < smallest[1].total:
                    smallest = (choices, estimate)
                if estimate.total > limit:
                    continue
                parts_key = (tp, ep, layout.sequence_parallel, precision, micro)
                if parts_key not in parts_cache:
                    parts_cache[parts_key] = op_parts(scaled[micro], choices, hardware)
                parts = parts_cache[parts_key]
                split: tuple[int, ...] = ()
                if pp > 1 and virtual == 1:
                    if (parts_key, pp) not in splits:
                        splits[parts_key, pp] = balanced_split(scaled[micro], choices, hardware, parts)
                    split = splits[parts_key, pp]
                cost = predict_step(
                    scaled[micro],
                    choices,
                    hardware,
                    virtual_stages=virtual,
                    devices_per_node=per_node,
                    stage_split=split or None,
                    parts=parts,
                )
                ranked.append(Candidate(choices, virtual, split, estimate, cost))
    if not ranked:
        detail = ""
        if smallest is not None:
            choices, estimate = smallest
            detail = (
                f": the smallest estimate is {estimate.total / _GIB:.2f} GiB per device (tp="
                f"{choices.tensor_parallel_size}, pp={choices.pipeline_parallel_size}, dp="
                f"{choices.data_parallel_size}, ZeRO-{choices.zero_stage}, "
                f"{choices.activation_checkpointing!r} checkpointing, {choices.mixed_precision})"
            )
        raise ConstraintError(
            f"no plan fits {1 - margin:.0%} of memory_per_device_gb={budget_gib:.2f}{detail}; use more "
            "devices, a smaller micro-batch or sequence, or relax a constraint"
        )
    return sorted(ranked, key=_rank_key)


def _sizes_with_experts(
    world_size: int,
    constraints: Constraints,
    per_node: int,
    head_counts: tuple[int, ...],
    profile: ModelProfile,
    expert_sizes: tuple[int, ...],
) -> list[tuple[int, int, int, int]]:
    """``(tp, pp, dp, ep)`` for every ep size that leaves a possible ``(tp, pp, dp)`` split."""
    sizes: list[tuple[int, int, int, int]] = []
    refused: ConstraintError | None = None
    for ep in expert_sizes:
        try:
            split = parallel_sizes(
                world_size // ep, constraints, per_node, head_counts, profile.pipeline_stage_limit
            )
        except ConstraintError as error:
            refused = refused or error
            continue
        sizes += [(tp, pp, dp, ep) for tp, pp, dp in split]
    if not sizes and refused is not None:
        raise refused
    return sizes


def seconds_per_sample(candidate: Candidate) -> float:
    """Step time over the samples of the step: the measure candidates are ranked by (without a
    ``global_batch_size`` constraint each split runs its own batch, ``dp x micro x micro-batches``)."""
    c = candidate.choices
    batch_ranks = c.data_parallel_size * c.expert_parallel_size
    return candidate.cost.step_time_s / (batch_ranks * c.micro_batch_size * c.num_microbatches)


def _rank_key(candidate: Candidate) -> tuple[Any, ...]:
    c = candidate.choices
    return (
        round(seconds_per_sample(candidate), 12),
        candidate.memory.total,
        c.tensor_parallel_size,
        c.pipeline_parallel_size,
        c.expert_parallel_size,
        c.zero_stage,
        ("none", "selective", "full").index(c.activation_checkpointing),
        c.mixed_precision,
        c.micro_batch_size,
        c.schedule,
        candidate.virtual_stages,
    )
