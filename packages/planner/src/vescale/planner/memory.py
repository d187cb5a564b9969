"""Memory per device of a parallel run, estimated from one meta-tensor forward of the model.

:func:`~vescale.planner.profile.profile_model` measures, without allocating, what one micro-batch
saves for backward per repeated block; :func:`estimate_from_profile` then divides what one
device holds for a :class:`ParallelChoices` (all sizes in bytes):

* ``E`` = parameter elements of the worst pipeline stage (``ceil(blocks / pp)`` blocks plus the
  embedding side or the head side, whichever is larger), each divided by ``tp`` when the
  sharding plan shards it;
* parameters = ``E * p / (dp if ZeRO-3)``, gradients = ``E * p / (dp if ZeRO >= 2)``, with
  ``p`` = 4 bytes (fp32) or 2 (bf16);
* optimizer state (AdamW) = ``E * (8 + m) / (dp if ZeRO >= 1)``: two fp32 moments, plus ``m`` = 4
  bytes of fp32 master weights in bf16 mixed precision (0 in fp32);
* activations = ``in_flight * (sum of A_block over the stage's blocks + A_outside)``, where
  ``A_block`` is what one block saves for one micro-batch (floating tensors halved in bf16;
  attention as a fused kernel saves it: q, k, v, output and log-sum-exp, no score matrix),
  ``A_outside`` the rest of the stage (embedding; final norm, head, loss and outputs), divided by
  ``tp`` inside the tensor-parallel region (everything but the inputs of
  column-parallel projections, integer tensors, and the tensors of unsharded modules with
  parameters such as norms, which only sequence parallelism divides); with
  ``activation_checkpointing="full"`` a block keeps only its input and one block's activations
  exist at a time during recomputation. ``in_flight`` is 1 without a pipeline, else the
  micro-batches the first stage holds: ``min(num_microbatches, pp)`` (1F1B) or
  ``num_microbatches`` (GPipe). ``"selective"`` is estimated as ``"none"`` (an upper bound).

Example::

    estimate = estimate_memory(model, ParallelChoices(data_parallel_size=8, zero_stage=1))
    print(estimate.total / 2**30, "GiB per device")
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate

from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.planner.errors import PlanError
from vescale.planner.profile import ModelProfile, profile_model

__all__ = ["MemoryEstimate", "ParallelChoices", "estimate_from_profile", "estimate_memory"]


@dataclass(frozen=True)
class ParallelChoices:
    """The choices of a plan that decide its memory per device (see the module docstring)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
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

    Example::

        estimate = estimate_memory(model, ParallelChoices())
        assert estimate.total == sum(estimate.to_dict().values())
    """

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        """The sum of the parts, in bytes."""
        return self.parameters + self.gradients + self.optimizer_states + self.activations

    def to_dict(self) -> dict[str, int]:
        """The parts as a JSON-ready dict of bytes."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, parts: dict[str, Any]) -> MemoryEstimate:
        """The estimate that :meth:`to_dict` wrote; raises ``PlanError`` naming a bad part."""
        names = [field.name for field in dataclasses.fields(cls)]
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


def _tp_sharded(plan: ShardingPlan, fqn: str) -> bool:
    decided = None
    for pattern, placements in plan.parameter:  # the last matching entry wins
        if re.fullmatch(pattern, fqn):
            decided = placements
    return decided is not None and not all(isinstance(p, Replicate) for p in decided)


def _column_input(plan: ShardingPlan, module_fqn: str) -> bool:
    return any(suffix == "input" and re.fullmatch(pattern, module_fqn) for pattern, suffix, _ in plan.forward)


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


def estimate_from_profile(profile: ModelProfile, choices: ParallelChoices) -> MemoryEstimate:
    """The memory per device of ``choices`` from a profile (the formula is the module docstring's).

    Example::

        profile = profile_model(model, sequence_length=512)
        estimate_from_profile(profile, ParallelChoices(sequence_length=512)).total
    """
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
    tp, pp, dp, zero = (
        choices.tensor_parallel_size,
        choices.pipeline_parallel_size,
        choices.data_parallel_size,
        choices.zero_stage,
    )
    blocks_per_stage = math.ceil(profile.num_blocks / pp) if profile.num_blocks else 0
    sides = ("first", "last") if pp > 1 else ("all",)
    bf16 = choices.mixed_precision == "bf16"
    plan = choices.sharding_plan
    divisors = _activation_divisors(profile, choices)
    best: MemoryEstimate | None = None
    for side in sides:
        # The first stage holds the first blocks, the last stage the last ones.
        first_block = profile.num_blocks - blocks_per_stage if side == "last" else 0
        stage_blocks = range(first_block, first_block + blocks_per_stage)
        elements = 0.0
        for record in profile.parameters:
            on_stage = record.block in stage_blocks
            on_stage = on_stage or (record.block is None and side in ("all", record.side))
            if on_stage:
                elements += record.numel / (tp if tp > 1 and _tp_sharded(plan, record.fqn) else 1)
        per_block: dict[int, float] = {}
        outside = 0.0
        for record in profile.saved:
            scale = 0.5 if bf16 and record.is_float else 1.0
            nbytes = record.nbytes * scale / (divisors[record.module_fqn] if record.is_float else 1)
            if record.block in stage_blocks:
                per_block[record.block] = per_block.get(record.block, 0.0) + nbytes
            elif record.block is None and side in ("all", record.side):
                outside += nbytes
        if choices.activation_checkpointing == "full":
            kept = blocks_per_stage * profile.block_input_bytes / (tp if choices.sequence_parallel else 1)
            # One block's activations exist again while it is recomputed for its backward.
            stage_activations = kept + max(per_block.values(), default=0.0) + outside
        else:
            stage_activations = sum(per_block.values()) + outside
        in_flight = 1
        if pp > 1 and side == "first":
            gpipe = choices.schedule == "gpipe"
            in_flight = choices.num_microbatches if gpipe else min(choices.num_microbatches, pp)
        parameter_bytes = 2 if bf16 else 4
        estimate = MemoryEstimate(
            parameters=int(elements * parameter_bytes / (dp if zero == 3 else 1)),
            gradients=int(elements * parameter_bytes / (dp if zero >= 2 else 1)),
            optimizer_states=int(elements * (8 + (4 if bf16 else 0)) / (dp if zero >= 1 else 1)),
            activations=int(in_flight * stage_activations),
        )
        if best is None or estimate.total > best.total:
            best = estimate
    return best


def estimate_memory(model: nn.Module, plan_choices: Any) -> MemoryEstimate:
    """The memory per device of running ``model`` with ``plan_choices`` (a ``ParallelChoices`` or ``Plan``).

    Example::

        estimate = estimate_memory(model, ParallelChoices(tensor_parallel_size=2, sequence_length=512))
        print(estimate.to_dict())
    """
    choices = plan_choices.parallel_choices() if hasattr(plan_choices, "parallel_choices") else plan_choices
    if not isinstance(choices, ParallelChoices):
        raise PlanError(
            f"estimate_memory takes a ParallelChoices or a Plan, got {type(plan_choices).__name__}"
        )
    profile = profile_model(model, choices.sequence_length, choices.micro_batch_size)
    return estimate_from_profile(profile, choices)
