"""``generate_plan``: the first planner, Megatron's rules on a meta-tensor memory estimate.

For a world of ``W`` devices, ``devices_per_node`` per node and a memory budget per device:

1. candidate model-parallel sizes ``(tp, pp)``: ``tp`` divides ``W``, stays inside a node
   (``tp <= devices_per_node``) and divides every attention head count; ``pp`` divides
   ``W / tp`` and is at most the number of repeated blocks; ``dp = W / (tp * pp)``;
2. they are tried smallest ``tp * pp`` first (ties: larger ``tp``, as TP within a node is cheaper
   than PP across nodes); for each, activation checkpointing ``"none"``, ``"selective"`` then
   ``"full"``, and ZeRO stages 0 to 3; the first that fits the budget
   (:mod:`vescale.planner.memory`) is the plan;
3. sequence parallelism is on when ``tp > 1``; every constraint set by the user replaces the
   corresponding loop with its one value, and a combination that cannot hold raises
   ``ConstraintError`` saying why.

The budget (``memory_per_device_gb``, in GiB) defaults to CUDA's total memory of device 0, or on
CPU to the machine's RAM shared by the ranks of one node.

Example::

    plan = generate_plan(model, {"zero.stage": 1}, world_size=8)
    print(plan)
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vescale.dmodule.auto_plan import AutoShardingResult, plan_tensor_parallel
from vescale.doptim.plan import DataParallelPlan
from vescale.dpipe.plan import PipelinePlan
from vescale.planner._meta_forward import meta_parameters
from vescale.planner._plan_reasons import explain_choices
from vescale.planner.constraints import Constraints
from vescale.planner.errors import ConstraintError
from vescale.planner.memory import MemoryEstimate, ParallelChoices, estimate_from_profile
from vescale.planner.plan import Plan
from vescale.planner.profile import profile_model

__all__ = ["default_memory_per_device_gb", "generate_plan"]

_GIB = 2**30
_DEFAULT_SEQUENCE_LENGTH = 2048


def default_memory_per_device_gb(devices_per_node: int) -> float:
    """CUDA's total memory of device 0 in GiB, else this machine's RAM over ``devices_per_node`` ranks.

    Example::

        budget = default_memory_per_device_gb(devices_per_node=8)
    """
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / _GIB
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / devices_per_node / _GIB


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def _default_sequence_length(model: nn.Module) -> tuple[int, str]:
    config = getattr(model, "config", None)
    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(longest, int) and longest < _DEFAULT_SEQUENCE_LENGTH:
        return longest, f"the model's longest sequence ({longest} positions)"
    return (
        _DEFAULT_SEQUENCE_LENGTH,
        f"default {_DEFAULT_SEQUENCE_LENGTH} (set the sequence_length constraint)",
    )


@dataclass(frozen=True)
class _Candidate:
    tp: int
    pp: int
    dp: int
    activation_checkpointing: str
    zero_stage: int


def _candidates(
    world_size: int, constraints: Constraints, per_node: int, head_counts: tuple[int, ...], blocks: int
) -> list[tuple[int, int, int]]:
    """``(tp, pp, dp)`` in the order they are tried; raises ``ConstraintError`` when none is possible."""
    tp_given = constraints.tensor_parallel_size
    if tp_given is not None:
        bad = sorted({heads for heads in head_counts if heads % tp_given})
        if bad:
            raise ConstraintError(
                f"tensor_parallel.size={tp_given} does not divide the attention head count(s) {bad} "
                "(larger than a head count, or not a divisor); choose a size that divides "
                f"{sorted(set(head_counts))}"
            )
    tps = [tp_given] if tp_given else [t for t in _divisors(world_size) if t <= per_node]
    tps = [t for t in tps if all(heads % t == 0 for heads in head_counts)]
    sizes = []
    for tp in tps:
        for pp in (
            [constraints.pipeline_parallel_size]
            if constraints.pipeline_parallel_size
            else _divisors(world_size // tp)
        ):
            dp = world_size // (tp * pp)
            if tp * pp * dp != world_size or (constraints.data_parallel_size not in (None, dp)):
                continue
            if pp > 1 and pp > blocks and constraints.pipeline_parallel_size is None:
                continue
            points = constraints.pipeline_parallel_split_points
            if points and pp != len(points) + 1:
                continue
            sizes.append((tp, pp, dp))
    if not sizes:
        raise ConstraintError(
            f"no (tensor, pipeline, data) parallel sizes multiply to the world size {world_size} with "
            f"{constraints.to_dict()}, tensor parallelism within devices_per_node={per_node} and dividing "
            f"the head counts {sorted(set(head_counts))}; relax a size constraint"
        )
    # Smallest model-parallel size first; on a tie, tensor parallelism inside the node before pipeline.
    return sorted(sizes, key=lambda size: (size[0] * size[1], -size[0]))


def _batches(constraints: Constraints, dp: int, pp: int) -> tuple[int, int] | None:
    """``(global_batch_size, micro_batch_size)`` for ``dp`` ranks, or ``None`` when they cannot split."""
    micro = constraints.micro_batch_size or 1
    if constraints.pipeline_parallel_num_microbatches and constraints.global_batch_size:
        share, rest = divmod(
            constraints.global_batch_size, dp * constraints.pipeline_parallel_num_microbatches
        )
        if rest or (constraints.micro_batch_size not in (None, share)):
            return None
        micro = share
    # Without a global batch: one micro-batch per pipeline stage, the fewest that fill the pipeline.
    micro_batches = constraints.pipeline_parallel_num_microbatches or pp
    global_batch = constraints.global_batch_size or dp * micro * micro_batches
    if global_batch % (dp * micro):
        return None
    return global_batch, micro


def generate_plan(
    model: nn.Module, constraints: dict | Constraints | None = None, *, world_size: int | None = None
) -> Plan:
    """Choose pp/dp/tp, SP, ZeRO, micro-batches and checkpointing so that ``model`` fits (module docstring).

    ``model`` may live on the meta device; nothing is allocated. ``world_size`` defaults to the
    initialised process group's, else 1.

    Example::

        with torch.device("meta"): model = LlamaForCausalLM(config)
        plan = generate_plan(model, {"devices_per_node": 8}, world_size=64)
        print(plan); print(plan.explain())
    """
    constraints = Constraints.from_dict(constraints)
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    constraints.check_world_size(world_size)
    reasons: dict[str, str] = {}
    per_node = constraints.devices_per_node
    if per_node is None:
        # Without a constraint: the GPUs this machine has, or on CPU every rank on this one machine.
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        per_node = min(cuda_devices or world_size, world_size)
    budget = constraints.memory_per_device_gb
    reasons["memory_per_device_gb"] = "constraint" if budget else "the device's memory"
    budget = budget or default_memory_per_device_gb(per_node)
    sequence_length, reasons["sequence_length"] = (
        (constraints.sequence_length, "constraint")
        if constraints.sequence_length
        else _default_sequence_length(model)
    )
    auto = _tensor_parallel_analysis(model, world_size, constraints)
    # Activations are measured per micro-batch size; most plans need only the first profile.
    profiles = {1: profile_model(model, sequence_length, 1)}
    sizes = _candidates(
        world_size, constraints, per_node, auto.head_counts if auto else (), profiles[1].num_blocks
    )
    mixed_precision = constraints.mixed_precision or "fp32"
    checkpointing = (
        [constraints.activation_checkpointing]
        if constraints.activation_checkpointing
        else ["none", "selective", "full"]
    )
    zero_stages = [constraints.zero_stage] if constraints.zero_stage is not None else [0, 1, 2, 3]
    smallest = None
    for (tp, pp, dp), recompute, zero in itertools.product(sizes, checkpointing, zero_stages):
        batches = _batches(constraints, dp, pp)
        if batches is None or (zero > 0 and dp == 1 and constraints.zero_stage is None):
            continue
        if constraints.sequence_parallel and tp == 1:
            continue
        sequence_parallel = (
            constraints.sequence_parallel if constraints.sequence_parallel is not None else tp > 1
        )
        global_batch, micro = batches
        num_microbatches = global_batch // (dp * micro)
        schedule = constraints.pipeline_parallel_schedule or ("1f1b" if num_microbatches >= pp else "gpipe")
        choices = ParallelChoices(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            sequence_parallel=sequence_parallel,
            zero_stage=zero,
            micro_batch_size=micro,
            sequence_length=sequence_length,
            num_microbatches=num_microbatches,
            schedule=schedule,
            mixed_precision=mixed_precision,
            activation_checkpointing=recompute,
            sharding_plan=auto.plan if auto and tp > 1 else None,
        )
        if micro not in profiles:
            profiles[micro] = profile_model(model, sequence_length, micro)
        estimate = estimate_from_profile(profiles[micro], choices)
        if smallest is None or estimate.total < smallest[1].total:
            smallest = (choices, estimate)
        if estimate.total <= budget * _GIB:
            return _assemble(model, auto, constraints, choices, estimate, budget, reasons, per_node)
    if smallest is None:
        raise ConstraintError(
            f"global_batch_size={constraints.global_batch_size} with micro_batch_size="
            f"{constraints.micro_batch_size} splits over none of the possible data-parallel sizes; make "
            "the global batch a multiple of dp x micro-batch"
        )
    choices, estimate = smallest
    raise ConstraintError(
        f"no plan fits memory_per_device_gb={budget:.2f}: the smallest estimate is "
        f"{estimate.total / _GIB:.2f} GiB per device (tp={choices.tensor_parallel_size}, "
        f"pp={choices.pipeline_parallel_size}, "
        f"dp={choices.data_parallel_size}, ZeRO-{choices.zero_stage}, activation_checkpointing="
        f"{choices.activation_checkpointing!r}); use more devices, bf16, a smaller micro-batch or sequence"
    )


def _tensor_parallel_analysis(
    model: nn.Module, world_size: int, constraints: Constraints
) -> AutoShardingResult | None:
    if world_size == 1 or constraints.tensor_parallel_size == 1:
        return None
    # On meta parameters: dmodule's trace answers data-dependent ops (MoE routing) on meta only.
    with meta_parameters(model):
        return plan_tensor_parallel(model)


def _assemble(
    model: nn.Module,
    auto: AutoShardingResult | None,
    constraints: Constraints,
    choices: ParallelChoices,
    estimate: MemoryEstimate,
    budget: float,
    reasons: dict[str, str],
    per_node: int,
) -> Plan:
    tp, pp = choices.tensor_parallel_size, choices.pipeline_parallel_size
    sharding_plan = None
    if tp > 1:
        # The analysis ran without sequence parallelism; with it the forward placements differ.
        sp = choices.sequence_parallel
        if sp:
            with meta_parameters(model):
                sharding_plan = plan_tensor_parallel(model, sequence_parallel=True).plan
        else:
            sharding_plan = auto.plan
    pipeline = None
    if pp > 1:
        pipeline = PipelinePlan(
            size=pp,
            split_method=constraints.pipeline_parallel_split_method
            or ("manual" if constraints.pipeline_parallel_split_points else "uniform"),
            split_points=constraints.pipeline_parallel_split_points or (),
            schedule=choices.schedule,
            num_microbatches=choices.num_microbatches,
        )
    reasons.update(explain_choices(constraints, choices, estimate, budget, per_node))
    return Plan(
        mesh={"pp": pp, "dp": choices.data_parallel_size, "tp": tp},
        data_parallel=DataParallelPlan(
            size=choices.data_parallel_size,
            zero_stage=choices.zero_stage,
            mixed_precision=choices.mixed_precision,
            deterministic=bool(constraints.data_parallel_deterministic),
        ),
        global_batch_size=choices.num_microbatches * choices.data_parallel_size * choices.micro_batch_size,
        micro_batch_size=choices.micro_batch_size,
        sequence_length=choices.sequence_length,
        sharding_plan=sharding_plan,
        sequence_parallel=choices.sequence_parallel,
        pipeline=pipeline,
        activation_checkpointing=choices.activation_checkpointing,
        memory_per_device_gb=float(budget),
        memory_estimate=estimate,
        reasons=tuple(reasons.items()),
    )
