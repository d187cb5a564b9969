"""Peak memory per device of a parallel run, estimated from one meta-tensor forward of the model.

:func:`~vescale.planner.profile.profile_model` measures, without allocating, what one micro-batch
saves for backward per repeated block; :func:`stage_sizes` then divides what one device of a
pipeline stage holds for a :class:`ParallelChoices` (all sizes in bytes), and
:mod:`vescale.planner.peak` finds the moment of the training step at which they add up most:

* ``E`` = parameter elements of the worst pipeline stage (``ceil(blocks / pp)`` blocks plus the
  embedding side or the head side, whichever is larger), each divided by ``tp`` when the
  sharding plan shards it;
* parameters = ``E * p / (dp if ZeRO-3)``, gradients kept after backward = ``E * p / (dp if
  ZeRO >= 2)``, with ``p`` = 4 bytes (fp32) or 2 (bf16);
* optimizer state (AdamW) = ``E * (8 + m) / (dp if ZeRO >= 1)``: two fp32 moments, plus ``m`` = 4
  bytes of fp32 master weights in bf16 mixed precision (0 in fp32);
* activations = ``in_flight * (sum of A_block over the stage's blocks + A_outside)``, where
  ``A_block`` is what one block saves for one micro-batch (floating tensors halved in bf16;
  attention as a fused kernel saves it: q, k, v, output and log-sum-exp, no score matrix),
  ``A_outside`` the rest of the stage (embedding; final norm, head, loss and outputs), divided by
  ``tp`` inside the tensor-parallel region (everything but the inputs of
  column-parallel projections, integer tensors, and the tensors of unsharded modules with
  parameters such as norms, which only sequence parallelism divides); with
  ``activation_checkpointing="full"`` a block keeps only its input (the forward keeps
  ``blocks * input + A_outside``), and one block's activations exist again while it is
  recomputed. ``in_flight`` is 1 without a pipeline, else the micro-batches a stage holds:
  the first stage ``min(num_microbatches, pp)`` (1F1B) and the last 1, or under GPipe (every
  forward before any backward) ``num_microbatches`` on both. A pipeline's last stage also
  keeps every micro-batch's logits (``vescale.dpipe`` returns them concatenated, as one device
  would) from its forward to the next step: beyond the micro-batches in flight, whose
  activations hold theirs, ``num_microbatches - in_flight`` times the largest float output of
  the head (``kept_outputs`` in :mod:`vescale.planner.peak`). With
  ``"selective"`` a block keeps its input and the outputs of its matmuls, attention kernels
  and tensor-parallel reductions (:mod:`vescale.planner.selective`): a matmul output is
  divided by ``tp`` where its module takes the replicated input of a column-parallel
  projection, kept whole where the module is row-parallel (its output is a partial sum), and
  then kept once more reduced (divided by ``tp`` under sequence parallelism); one block's
  other activations exist again while it is recomputed, as under ``"full"``.

Under expert parallelism (``expert_parallel_size = ep > 1``) each rank holds E/ep of every
experts module's parameters (tensor parallelism stays outside them), and ZeRO divides the rest
by dp x ep (the batch ranks) and the experts by dp. While an MoE layer runs, its all-to-all
buffers exist beside everything else: the ``tokens x top_k`` hidden states sent and as many
received (a balanced routing), ``2 * micro_batch * sequence * top_k * hidden`` elements
(temporaries in :mod:`vescale.planner.peak`).

The :class:`MemoryEstimate` gives each part as held at the peak moment, and the short-lived
buffers there (``temporaries``); ``total`` is the peak.

Example::

    estimate = estimate_memory(model, ParallelChoices(data_parallel_size=8, zero_stage=1))
    print(estimate.total / 2**30, "GiB per device")
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.planner.errors import PlanError
from vescale.planner.peak import StageSizes, peak_moments
from vescale.planner.profile import ModelProfile, profile_model

__all__ = [
    "MemoryEstimate",
    "ParallelChoices",
    "estimate_from_profile",
    "estimate_memory",
    "peak_of_stages",
    "publishes_in_place",
    "stage_sizes",
]


@dataclass(frozen=True)
class ParallelChoices:
    """The choices of a plan that decide its memory per device (see the module docstring)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    micro_batch_size: int = 1
    sequence_length: int = 128
    num_microbatches: int = 1
    schedule: str = "1f1b"
    mixed_precision: str = "fp32"
    activation_checkpointing: str = "none"
    sharding_plan: ShardingPlan | None = None


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds at its peak, by part (see the module docstring for the formula).

    Each part is what is held at the peak moment (:mod:`vescale.planner.peak`): at the start of
    backward every activation the forward kept, at the optimizer step none. ``temporaries`` are
    the short-lived buffers there (loss gradients, ZeRO-3's unsharded parameters, the ZeRO-1/2
    parameter all-gather); plans written before it existed read it as 0.

    Example::

        estimate = estimate_memory(model, ParallelChoices())
        assert estimate.total == sum(estimate.to_dict().values())
    """

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    temporaries: int = 0

    @property
    def total(self) -> int:
        """The sum of the parts, in bytes."""
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.temporaries

    def to_dict(self) -> dict[str, int]:
        """The parts as a JSON-ready dict of bytes."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, parts: dict[str, Any]) -> MemoryEstimate:
        """The estimate that :meth:`to_dict` wrote; raises ``PlanError`` naming a bad part."""
        names = [field.name for field in dataclasses.fields(cls)]
        if isinstance(parts, dict) and "temporaries" not in parts:
            parts = {**parts, "temporaries": 0}  # written before the estimate had temporaries
        if not isinstance(parts, dict) or sorted(parts) != sorted(names):
            raise PlanError(
                f"memory_estimate must be a dict with exactly the keys {names} (bytes), got {parts!r}"
            )
        for name, value in parts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(
                    f"memory_estimate.{name} must be a non-negative number of bytes, got {value!r}"
                )
        return cls(**parts)


# Plan -> (its regex answers by FQN): a search asks the same questions thousands of times.
# transformers' fused experts: 3-D weights (and their biases) of a module named "experts".
_EXPERT_PARAMETER = re.compile(r"(^|\.)experts\.(gate_up_proj|up_proj|down_proj)(_bias)?$")
_PLAN_ANSWERS: dict[int, tuple[ShardingPlan, dict[str, bool], dict[str, bool]]] = {}


def _answers(plan: ShardingPlan) -> tuple[dict[str, bool], dict[str, bool]]:
    entry = _PLAN_ANSWERS.get(id(plan))
    if entry is None or entry[0] is not plan:
        if len(_PLAN_ANSWERS) >= 16:
            _PLAN_ANSWERS.clear()
        entry = _PLAN_ANSWERS[id(plan)] = (plan, {}, {})
    return entry[1], entry[2]


def _tp_sharded(plan: ShardingPlan, fqn: str) -> bool:
    sharded, _ = _answers(plan)
    if fqn not in sharded:
        decided = None
        for pattern, placements in plan.parameter:  # the last matching entry wins
            if re.fullmatch(pattern, fqn):
                decided = placements
        sharded[fqn] = decided is not None and not all(isinstance(p, Replicate) for p in decided)
    return sharded[fqn]


def _column_input(plan: ShardingPlan, module_fqn: str) -> bool:
    _, column = _answers(plan)
    if module_fqn not in column:
        column[module_fqn] = any(
            suffix == "input" and re.fullmatch(pattern, module_fqn) for pattern, suffix, _ in plan.forward
        )
    return column[module_fqn]


def _activation_divisors(profile: ModelProfile, choices: ParallelChoices) -> dict[str, int]:
    """Module FQN -> what tensor parallelism divides the floating tensors it saves by."""
    tp, plan = choices.tensor_parallel_size, choices.sharding_plan
    divisors = {}
    for module_fqn in {record.module_fqn for record in profile.saved}:
        owned = profile.module_parameters.get(module_fqn, ())
        if tp == 1 or plan is None or _column_input(plan, module_fqn):
            divisors[module_fqn] = 1
        elif owned and not any(_tp_sharded(plan, fqn) for fqn in owned):
            # A norm: whole on every tensor-parallel rank unless the sequence is sharded.
            divisors[module_fqn] = tp if choices.sequence_parallel else 1
        else:
            divisors[module_fqn] = tp
    return divisors


def _selective_block_bytes(profile: ModelProfile, choices: ParallelChoices) -> dict[int, float]:
    """Block -> what ``"selective"`` keeps of it besides its input (see the module docstring)."""
    tp, plan = choices.tensor_parallel_size, choices.sharding_plan
    bf16 = choices.mixed_precision == "bf16"
    kept: dict[int, float] = {}
    for record in profile.selective_kept:
        if record.block is None:
            continue
        nbytes = record.nbytes * (0.5 if bf16 and record.is_float else 1.0)
        owned = profile.module_parameters.get(record.module_fqn, ())
        if tp == 1 or plan is None or not record.is_float:
            local = nbytes
        elif _column_input(plan, record.module_fqn) or not any(_tp_sharded(plan, fqn) for fqn in owned):
            local = nbytes / tp  # a column-parallel output, or attention over this rank's heads
        else:  # row-parallel: the partial sum, then its all-reduce or reduce-scatter
            local = nbytes + nbytes / (tp if choices.sequence_parallel else 1)
        kept[record.block] = kept.get(record.block, 0.0) + local
    return kept


def _stage_sizes(profile: ModelProfile, choices: ParallelChoices, side: str) -> tuple[StageSizes, float]:
    """What one device of the pipeline stage on ``side`` holds before ZeRO divides it, and the one
    divisor ZeRO divides its parameters by (dp; under expert parallelism the mix of dp x ep for the
    rest and dp for the experts)."""
    tp, pp, dp, zero = (
        choices.tensor_parallel_size,
        choices.pipeline_parallel_size,
        choices.data_parallel_size,
        choices.zero_stage,
    )
    bf16 = choices.mixed_precision == "bf16"
    parameter_bytes = 2 if bf16 else 4
    blocks_per_stage = math.ceil(profile.num_blocks / pp) if profile.num_blocks else 0
    # The first stage holds the first blocks, the last stage the last ones.
    first_block = profile.num_blocks - blocks_per_stage if side == "last" else 0
    stage_blocks = range(first_block, first_block + blocks_per_stage)
    ep = choices.expert_parallel_size
    elements, outside_elements, head_elements, largest, expert_elements = 0.0, 0.0, 0.0, 0.0, 0.0
    block_elements: dict[int, float] = {}
    for record in profile.parameters:
        on_stage = record.block in stage_blocks
        on_stage = on_stage or (record.block is None and side in ("all", record.side))
        if not on_stage:
            continue
        if tp > 1 and choices.sharding_plan is None:
            raise PlanError(
                f"tensor_parallel_size={tp} but the choices carry no sharding_plan to place parameter "
                f"{record.fqn!r} with; give ParallelChoices the tensor-parallel plan"
            )
        sharded = (
            choices.sharding_plan is not None and tp > 1 and _tp_sharded(choices.sharding_plan, record.fqn)
        )
        if ep > 1 and _EXPERT_PARAMETER.search(record.fqn):
            # Expert parallelism: E/ep whole experts per rank (tensor parallelism stays outside them).
            local = record.numel / ep
            expert_elements += local
        else:
            local = record.numel / (tp if sharded else 1)
        elements += local
        largest = max(largest, local)
        if record.block is None:
            outside_elements += local
            head_elements += local if record.side == "last" else 0.0
        else:
            block_elements[record.block] = block_elements.get(record.block, 0.0) + local
    divisors = _activation_divisors(profile, choices)
    per_block: dict[int, float] = {}
    outside = first_side = largest_output = 0.0
    for saved in profile.saved:
        scale = 0.5 if bf16 and saved.is_float else 1.0
        nbytes = saved.nbytes * scale / (divisors[saved.module_fqn] if saved.is_float else 1)
        if saved.block is not None and saved.block in stage_blocks:
            per_block[saved.block] = per_block.get(saved.block, 0.0) + nbytes
        elif saved.block is None and side in ("all", saved.side):
            outside += nbytes
            first_side += nbytes if saved.side == "first" else 0.0
            if saved.side == "last" and saved.is_float:
                largest_output = max(largest_output, nbytes)
    largest_block = max(per_block.values(), default=0.0)
    recompute, last = 0.0, first_side + largest_block
    if choices.activation_checkpointing in ("full", "selective"):
        block_input = profile.block_input_bytes / (tp if choices.sequence_parallel else 1)
        kept_inside = [0.0] * blocks_per_stage
        if choices.activation_checkpointing == "selective":
            selective = _selective_block_bytes(profile, choices)
            kept_inside = [selective.get(block, 0.0) for block in stage_blocks]
        stage_activations = blocks_per_stage * block_input + sum(kept_inside) + outside
        # One block's activations exist again while it is recomputed, once the head's are freed.
        recompute = max(0.0, largest_block - (outside - first_side))
        last += block_input + max(kept_inside, default=0.0)
    else:
        stage_activations = sum(per_block.values()) + outside
    in_flight, kept_outputs = 1, 0.0
    if pp > 1:
        gpipe = choices.schedule == "gpipe"
        if gpipe:
            in_flight = choices.num_microbatches
        elif side == "first":
            in_flight = min(choices.num_microbatches, pp)
        if side == "last":  # the in-flight micro-batches' logits are among their activations
            kept_outputs = (choices.num_microbatches - in_flight) * largest_output
    divisor = (
        dp if ep == 1 or not elements else elements / _zero_elements(elements, expert_elements, dp, ep, True)
    )
    sizes = StageSizes(
        parameters=elements * parameter_bytes,
        outside_parameters=outside_elements * parameter_bytes,
        head_parameters=head_elements * parameter_bytes,
        largest_block_parameters=max(block_elements.values(), default=0.0) * parameter_bytes,
        largest_parameter=largest * 4,  # the optimizer steps fp32 tensors (masters in bf16)
        optimizer_states=_zero_elements(elements, expert_elements, dp, ep, zero >= 1)
        * (8 + (4 if bf16 else 0)),
        activations=in_flight * stage_activations,
        last_activations=in_flight * last,
        loss_gradients=2 * largest_output,
        recompute=recompute,
        dispatch_buffers=_dispatch_bytes(profile, choices),
        kept_outputs=kept_outputs,
    )
    return sizes, divisor


def _dispatch_bytes(profile: ModelProfile, choices: ParallelChoices) -> float:
    """One MoE layer's all-to-all send and receive buffers under expert parallelism (module docstring)."""
    if choices.expert_parallel_size == 1 or not profile.expert_top_k:
        return 0.0
    # A block's input is the micro-batch's hidden states; every tp rank dispatches all of them.
    hidden_states = profile.block_input_bytes * (0.5 if choices.mixed_precision == "bf16" else 1.0)
    return 2.0 * profile.expert_top_k * hidden_states


def _zero_elements(elements: float, expert_elements: float, dp: int, ep: int, sharded: bool) -> float:
    """Elements per rank of a ZeRO-sharded part: the rest over dp x ep, the experts (E/ep already)
    over dp; unsharded, all of them."""
    if not sharded:
        return elements
    return (elements - expert_elements) / (dp * ep) + expert_elements / dp


def stage_sizes(profile: ModelProfile, choices: ParallelChoices) -> list[StageSizes]:
    """The sizes of each pipeline stage that bounds memory: the first and the last (or the only one).

    Example::

        forward_activations = max(sizes.activations for sizes in stage_sizes(profile, choices))
    """
    return [sizes for sizes, _ in _sizes_and_divisors(profile, choices)]


def _sizes_and_divisors(profile: ModelProfile, choices: ParallelChoices) -> list[tuple[StageSizes, float]]:
    taken = (profile.micro_batch_size, profile.sequence_length)
    if (choices.micro_batch_size, choices.sequence_length) != taken:
        raise PlanError(
            f"the profile was taken at micro_batch_size={taken[0]}, sequence_length={taken[1]}; the "
            f"choices ask for {choices.micro_batch_size}, {choices.sequence_length}: profile the model "
            "again at those sizes"
        )
    if choices.tensor_parallel_size > 1 and choices.sharding_plan is None:
        raise PlanError(
            f"tensor_parallel_size={choices.tensor_parallel_size} needs the sharding_plan (which tensors "
            "it divides); pass ParallelChoices(sharding_plan=plan_tensor_parallel(model).plan, ...)"
        )
    sides = ("first", "last") if choices.pipeline_parallel_size > 1 else ("all",)
    return [_stage_sizes(profile, choices, side) for side in sides]


def estimate_from_profile(
    profile: ModelProfile, choices: ParallelChoices, *, publish_in_place: bool = False
) -> MemoryEstimate:
    """The peak memory per device of ``choices`` from a profile (module docstring, :mod:`~.peak`);
    ``publish_in_place`` where ZeRO-1/2 publish by in-place broadcasts (gloo: CPU ranks).

    Example::

        profile = profile_model(model, sequence_length=512)
        estimate_from_profile(profile, ParallelChoices(sequence_length=512)).total
    """
    return peak_of_stages(_sizes_and_divisors(profile, choices), choices, publish_in_place=publish_in_place)


def peak_of_stages(
    stages: Iterable[tuple[StageSizes, float]], choices: ParallelChoices, *, publish_in_place: bool = False
) -> MemoryEstimate:
    """The largest peak (:func:`~vescale.planner.peak.peak_moments`) over the pipeline stages that
    bound memory, each given as its sizes and the divisor ZeRO applies to its states.

    Example::

        estimate = peak_of_stages([(sizes, 8.0)], ParallelChoices(data_parallel_size=8, zero_stage=3))
    """
    best: MemoryEstimate | None = None
    for sizes, divisor in stages:
        moments = peak_moments(
            sizes,
            divisor,
            choices.zero_stage,
            num_microbatches=choices.num_microbatches,
            publish_in_place=publish_in_place,
        )
        estimate = MemoryEstimate(*(int(part) for part in max(moments.values(), key=sum)))
        if best is None or estimate.total > best.total:
            best = estimate
    if best is None:
        raise PlanError(
            f"no pipeline stage to estimate the memory of for {choices}; use a size of at least 1"
        )
    return best


def publishes_in_place(hardware_name: str | None) -> bool:
    """Whether ZeRO-1/2 publish by in-place broadcasts (gloo) on the devices a plan is for: the
    ``cpu`` profile's, or without a profile (``None``) this machine's when it has no GPU.

    Example::

        publishes_in_place("h100-80gb")  # False: NCCL all-gathers into buffers
    """
    if hardware_name is None:
        return not torch.cuda.is_available()
    return hardware_name == "cpu"


def estimate_memory(
    model: nn.Module, plan_choices: Any, *, publish_in_place: bool | None = None
) -> MemoryEstimate:
    """The memory per device of running ``model`` with ``plan_choices`` (a ``ParallelChoices`` or ``Plan``);
    ``publish_in_place`` where ZeRO-1/2 publish by in-place broadcasts (gloo: CPU ranks), by default
    as ``generate_plan`` assumed (:func:`publishes_in_place` of a plan's hardware, else this machine).

    Example::

        estimate = estimate_memory(model, ParallelChoices(tensor_parallel_size=2, sequence_length=512))
        print(estimate.to_dict())
    """
    choices = plan_choices.parallel_choices() if hasattr(plan_choices, "parallel_choices") else plan_choices
    if not isinstance(choices, ParallelChoices):
        raise PlanError(
            f"estimate_memory takes a ParallelChoices or a Plan, got {type(plan_choices).__name__}"
        )
    if publish_in_place is None:
        performance = getattr(plan_choices, "performance", None)
        publish_in_place = publishes_in_place(performance.hardware if performance is not None else None)
    profile = profile_model(model, choices.sequence_length, choices.micro_batch_size)
    return estimate_from_profile(profile, choices, publish_in_place=publish_in_place)
