"""``generate_plan``: the fastest predicted plan on a hardware profile, or Megatron's rules.

With a hardware profile (the ``hardware`` constraint or argument: a built-in name, ``"cpu"``
measured now, or a JSON file) the plan is the fastest one the step-time model
(:mod:`vescale.planner.cost`) predicts among those whose memory estimate fits with a margin
(:mod:`vescale.planner.search`; for a model with MoE blocks over the ep sizes too, the all-to-alls
priced); the rule-based choice below is costed beside it in the reasons.
Without one, the rules choose. For a world of ``W`` devices, ``devices_per_node`` per node and a
memory budget per device:

1. candidate model-parallel sizes ``(tp, pp)``: ``tp`` divides ``W``, stays inside a node
   (``tp <= devices_per_node``) and divides every attention head count; ``pp`` divides
   ``W / tp`` and is at most the number of repeated blocks; ``dp = W / (tp * pp)``;
2. they are tried smallest ``tp * pp`` first (ties: larger ``tp``, as TP within a node is cheaper
   than PP across nodes); for each, activation checkpointing ``"none"``, ``"selective"`` then
   ``"full"``, and ZeRO stages 0 to 3, and innermost, for a model with MoE blocks, the expert-parallel
   sizes ``ep`` (1 first, then each divisor of the world that splits every experts module into whole
   experts; ``dp = W / (tp * pp * ep)``); the first that fits the budget
   (:mod:`vescale.planner.memory`) is the plan;
3. sequence parallelism is on when ``tp > 1``; every constraint set by the user replaces the
   corresponding loop with its one value, and a combination that cannot hold raises
   ``ConstraintError`` saying why.

The budget (``memory_per_device_gb``, in GiB) defaults to the profile's memory, else CUDA's total
memory of device 0, or on CPU to the machine's RAM shared by the ranks of one node. Planning for
more devices than this machine has (outside a process group) with neither a profile nor a budget
is refused: this machine's memory says nothing about them.

Example::

    plan = generate_plan(model, {"zero.stage": 1}, world_size=8)
    print(plan)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vescale.dmodule.auto_plan import AutoShardingResult, plan_tensor_parallel
from vescale.dmodule.experts import find_moe_blocks
from vescale.planner._assembly import assemble_plan
from vescale.planner._cost_planning import plan_by_cost
from vescale.planner._meta_forward import meta_parameters
from vescale.planner._parallel_sizes import batches, candidate_layout, divisors, parallel_sizes
from vescale.planner._sequence_length import default_sequence_length, profile_at_default_length
from vescale.planner.constraints import Constraints
from vescale.planner.errors import ConstraintError, PlanError
from vescale.planner.hardware import HardwareProfile, load_hardware
from vescale.planner.memory import MemoryEstimate, ParallelChoices, estimate_from_profile, publishes_in_place
from vescale.planner.plan import Plan
from vescale.planner.profile import ModelProfile, profile_model
from vescale.planner.search import Cluster

__all__ = ["default_memory_per_device_gb", "expert_parallel_sizes", "generate_plan"]

_GIB = 2**30
_CPU_RANKS_PER_MACHINE = 8


def default_memory_per_device_gb(devices_per_node: int) -> float:
    """CUDA's total memory of device 0 in GiB, else this machine's RAM over ``devices_per_node`` ranks.

    Example::

        budget = default_memory_per_device_gb(devices_per_node=8)
    """
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / _GIB
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / devices_per_node / _GIB


def generate_plan(
    model: nn.Module,
    constraints: dict[str, Any] | Constraints | None = None,
    *,
    world_size: int | None = None,
    hardware: str | HardwareProfile | None = None,
    method: str = "auto",
    top_k: int = 5,
) -> Plan:
    """Choose pp/dp/tp, SP, ZeRO, micro-batches and checkpointing for ``model`` (module docstring).

    ``model`` may live on the meta device; nothing is allocated. ``world_size`` defaults to the
    initialised process group's, else 1. With a hardware profile (``hardware``, or the
    ``hardware`` constraint) the plan is the fastest predicted one that fits
    (:mod:`vescale.planner.search`), with a ``performance`` section and ``top_k`` runners-up;
    without one, Megatron's rules choose. ``method`` forces one: ``"cost"`` or ``"rules"``.

    Example::

        with torch.device("meta"): model = LlamaForCausalLM(config)
        plan = generate_plan(model, {"hardware": "h100-80gb"}, world_size=1024)
        print(plan); print(plan.explain())
    """
    if method not in ("auto", "cost", "rules"):
        raise PlanError(f"method={method!r} is not one of 'auto', 'cost', 'rules'")
    constraints = Constraints.from_dict(constraints)
    process_group = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if process_group else 1
    constraints.check_world_size(world_size)
    profile_name = hardware or constraints.hardware
    if method == "cost" and profile_name is None:
        raise PlanError(
            "method='cost' needs a hardware profile: pass hardware='h100-80gb' (or 'cpu', a JSON file)"
        )
    hardware_profile = None
    if profile_name is not None and method != "rules":
        hardware_profile = load_hardware(profile_name, world_size=min(world_size, 8))
    reasons: dict[str, str] = {}
    per_node = constraints.devices_per_node
    if per_node is None and hardware_profile is not None:
        per_node = min(hardware_profile.devices_per_node, world_size)
    if per_node is None:
        # Without a constraint: the GPUs this machine has, or on CPU every rank on this one machine.
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        per_node = min(cuda_devices or world_size, world_size)
    budget = constraints.memory_per_device_gb
    if budget is None and hardware_profile is None and not process_group:
        _check_this_machine_has(world_size)
    reasons["memory_per_device_gb"] = "constraint" if budget else "the device's memory"
    if budget is None and hardware_profile is not None:
        budget = hardware_profile.memory_gb
        reasons["memory_per_device_gb"] = f"the {hardware_profile.name} profile's memory"
    budget = budget or default_memory_per_device_gb(per_node)
    _check_expert_parallel(model, constraints)
    auto = _tensor_parallel_analysis(model, world_size, constraints)
    # Activations are measured per micro-batch size; most plans need only the first profile.
    if constraints.sequence_length:
        sequence_length, reasons["sequence_length"] = constraints.sequence_length, "constraint"
        profiles = {1: profile_model(model, sequence_length, 1)}
    else:
        profile, sequence_length, reasons["sequence_length"] = profile_at_default_length(
            model, *default_sequence_length(model)
        )
        profiles = {1: profile}
    _check_pipeline_output(model, constraints, profiles[1])
    # ZeRO-1/2's publish needs no gather buffers on gloo (CPU ranks).
    in_place = publishes_in_place(hardware_profile.name if hardware_profile is not None else None)
    if hardware_profile is None:
        choices, estimate = _rule_based_choice(
            model, constraints, world_size, per_node, budget, sequence_length, auto, profiles, in_place
        )
        virtual_stages = constraints.stages_per_pipeline_rank  # the rules never choose ZBV themselves
        return assemble_plan(
            model,
            auto,
            constraints,
            choices,
            estimate,
            budget,
            reasons,
            per_node,
            virtual_stages=virtual_stages if choices.pipeline_parallel_size > 1 else 1,
        )
    try:
        rule_choice = _rule_based_choice(
            model,
            constraints,
            world_size,
            per_node,
            budget,
            sequence_length,
            auto,
            profiles,
            in_place,
        )[0]
    except ConstraintError:
        rule_choice = None
    return plan_by_cost(
        model,
        profiles[1],
        constraints,
        Cluster(hardware_profile, world_size=world_size, per_node=per_node, budget_gib=budget),
        auto=auto,
        reasons=reasons,
        top_k=top_k,
        rule_choice=rule_choice,
        expert_sizes=tuple(expert_parallel_sizes(model, constraints, world_size)),
    )


def _check_expert_parallel(model: nn.Module, constraints: Constraints) -> None:
    """Refuse an ep size the model's MoE blocks cannot split into whole experts per rank."""
    ep = constraints.expert_parallel_size or 1
    if ep == 1:
        return
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ConstraintError(
            f"expert_parallel.size={ep}, but {type(model).__name__} has no MoE block (fused experts "
            "beside a router); drop expert_parallel.size"
        )
    uneven = [block for block in blocks if block.num_experts % ep]
    if uneven:
        raise ConstraintError(
            f"expert_parallel.size={ep} does not divide the {uneven[0].num_experts} experts of "
            f"{uneven[0].experts_fqn}; choose an ep size that divides the number of experts"
        )


def _check_this_machine_has(world_size: int) -> None:
    """Refuse to plan for more devices than this machine has without saying what they are."""
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # CPU ranks are processes: up to 8 of them share one machine in veScale's tests and benches.
    local = cuda_devices or max(os.cpu_count() or 1, _CPU_RANKS_PER_MACHINE)
    if world_size > local:
        raise ConstraintError(
            f"planning for {world_size} devices, but this machine has {local}: say what the devices are, "
            "with a hardware profile (constraint hardware='h100-80gb', a JSON file, or vescale plan "
            "--hardware) or the memory_per_device_gb constraint"
        )


def _check_pipeline_output(model: nn.Module, constraints: Constraints, profile: ModelProfile) -> None:
    """Refuse a pipeline constraint for a model whose output a pipeline cannot return."""
    split_points = constraints.pipeline_parallel_split_points
    pipelined = (constraints.pipeline_parallel_size or 1) > 1 or bool(split_points)
    if pipelined and not profile.pipelinable_output:
        raise ConstraintError(
            f"{type(model).__name__} returns {profile.output_type_name}, which has no `loss` and `logits` "
            "for a pipeline to return (question-answering heads, bare tensors); drop the "
            "pipeline_parallel constraints: the planner then uses tensor and data parallelism"
        )


def _rule_based_choice(
    model: nn.Module,
    constraints: Constraints,
    world_size: int,
    per_node: int,
    budget: float,
    sequence_length: int,
    auto: AutoShardingResult | None,
    profiles: dict[int, ModelProfile],
    publish_in_place: bool,
) -> tuple[ParallelChoices, MemoryEstimate]:
    """Megatron's rules: the first candidate in the rule order whose estimate fits the budget."""
    mixed_precision = constraints.mixed_precision or "fp32"
    checkpointing = (
        [constraints.activation_checkpointing]
        if constraints.activation_checkpointing
        else ["none", "selective", "full"]
    )
    zero_stages = [constraints.zero_stage] if constraints.zero_stage is not None else [0, 1, 2, 3]
    plans = {False: auto.plan, True: auto.plan} if auto else {}
    smallest = None
    for tp, pp, dp, ep, recompute, zero in _rule_order(
        model,
        constraints,
        world_size,
        per_node,
        auto,
        profiles[1].pipeline_stage_limit,
        checkpointing,
        zero_stages,
    ):
        split = batches(constraints, dp * ep, pp)
        layout = candidate_layout(
            constraints, (tp, pp, dp, ep), zero, recompute, mixed_precision, sequence_length, plans
        )
        if split is None or layout is None:
            continue
        global_batch, micro = split
        num_microbatches = global_batch // (dp * ep * micro)
        schedule = constraints.pipeline_parallel_schedule or _rule_based_schedule(
            num_microbatches, pp, constraints.pipeline_parallel_virtual_stages
        )
        choices = dataclasses.replace(
            layout, micro_batch_size=micro, num_microbatches=num_microbatches, schedule=schedule
        )
        if micro not in profiles:
            profiles[micro] = profile_model(model, sequence_length, micro)
        estimate = estimate_from_profile(profiles[micro], choices, publish_in_place=publish_in_place)
        if smallest is None or estimate.total < smallest[1].total:
            smallest = (choices, estimate)
        if estimate.total <= budget * _GIB:
            return choices, estimate
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
        f"pp={choices.pipeline_parallel_size}, dp={choices.data_parallel_size}, "
        f"ep={choices.expert_parallel_size}, ZeRO-{choices.zero_stage}, activation_checkpointing="
        f"{choices.activation_checkpointing!r}); use more devices, bf16, a smaller micro-batch or sequence"
    )


def _rule_based_schedule(num_microbatches: int, pp: int, virtual_stages: int | None) -> str:
    """Megatron's rule: 1F1B where every stage can hold a micro-batch in flight, else GPipe; with
    several stages per rank (``pipeline_parallel.virtual_stages``), interleaved 1F1B."""
    if virtual_stages is not None and virtual_stages > 1:
        return "interleaved_1f1b"
    return "1f1b" if num_microbatches >= pp else "gpipe"


def expert_parallel_sizes(model: nn.Module, constraints: Constraints, world_size: int) -> list[int]:
    """The ep sizes a plan may use, smallest first: the constraint's, else 1 and every divisor of the
    world size that splits each MoE block into whole experts per rank (only 1 without MoE blocks).

    Example::

        expert_parallel_sizes(tiny_moe("mixtral"), Constraints(), world_size=4)   # [1, 2, 4]
    """
    if constraints.expert_parallel_size is not None:
        return [constraints.expert_parallel_size]
    experts = [block.num_experts for block in find_moe_blocks(model)]
    if not experts:
        return [1]
    return [ep for ep in divisors(world_size) if all(count % ep == 0 for count in experts)]


def _rule_order(
    model: nn.Module,
    constraints: Constraints,
    world_size: int,
    per_node: int,
    auto: AutoShardingResult | None,
    blocks: int,
    checkpointing: list[str],
    zero_stages: list[int],
) -> Iterator[tuple[int, int, int, int, str, int]]:
    """``(tp, pp, dp, ep, checkpointing, ZeRO stage)`` in the rule order: the smallest model-parallel
    size ``tp x pp`` first (module docstring); for each, checkpointing and ZeRO stages as before, and
    the ep sizes innermost, smallest first: expert parallelism divides the experts' parameters,
    gradients and optimizer state for one all-to-all of the tokens per MoE layer, where ZeRO-3 would
    gather every expert each step."""
    heads = auto.head_counts if auto else ()
    by_model_parallel: dict[tuple[int, int], list[tuple[int, int]]] = {}
    error: ConstraintError | None = None
    for ep in expert_parallel_sizes(model, constraints, world_size):
        try:
            sizes = parallel_sizes(world_size // ep, constraints, per_node, heads, blocks)
        except ConstraintError as refused:
            error = error or refused
            continue
        for tp, pp, dp in sizes:
            by_model_parallel.setdefault((tp, pp), []).append((dp, ep))
    if not by_model_parallel:
        if error is None:  # expert_parallel_sizes always lists at least one size
            raise ConstraintError(f"no parallel sizes for world {world_size} with {constraints.to_dict()}")
        raise error
    for tp, pp in sorted(by_model_parallel, key=lambda size: (size[0] * size[1], -size[0])):
        for recompute, zero in itertools.product(checkpointing, zero_stages):
            for dp, ep in by_model_parallel[tp, pp]:
                yield tp, pp, dp, ep, recompute, zero


def _tensor_parallel_analysis(
    model: nn.Module, world_size: int, constraints: Constraints
) -> AutoShardingResult | None:
    if world_size == 1 or constraints.tensor_parallel_size == 1:
        return None
    # On meta parameters: dmodule's trace answers data-dependent ops (MoE routing) on meta only.
    with meta_parameters(model):
        return plan_tensor_parallel(model)
