"""The parallel sizes a world can be split into, the batches and sequence parallelism each
split can run, and the choices of one candidate layout.

Shared by the rule-based planner and the cost-model search (:mod:`vescale.planner.search`).

Example::

    sizes = parallel_sizes(64, Constraints(), per_node=8, head_counts=(32, 8), blocks=32)
"""

from __future__ import annotations

from collections.abc import Mapping

from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.planner.constraints import Constraints
from vescale.planner.errors import ConstraintError
from vescale.planner.memory import ParallelChoices

__all__ = ["batches", "candidate_layout", "divisors", "parallel_sizes", "sequence_parallel_for"]


def divisors(number: int) -> list[int]:
    """The divisors of ``number``, ascending."""
    return [d for d in range(1, number + 1) if number % d == 0]


def parallel_sizes(
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
    tps = [tp_given] if tp_given else [t for t in divisors(world_size) if t <= per_node]
    tps = [t for t in tps if all(heads % t == 0 for heads in head_counts)]
    sizes = []
    for tp in tps:
        for pp in (
            [constraints.pipeline_parallel_size]
            if constraints.pipeline_parallel_size
            else divisors(world_size // tp)
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


def batches(constraints: Constraints, dp: int, pp: int) -> tuple[int, int] | None:
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


def sequence_parallel_for(constraints: Constraints, tp: int) -> bool | None:
    """Whether a ``tp``-way candidate shards activations along the sequence: the constraint's
    choice, else whenever there is tensor parallelism (Megatron's default); ``None`` where the
    constraint asks for it and ``tp`` is 1 (no such candidate)."""
    if constraints.sequence_parallel is None:
        return tp > 1
    if constraints.sequence_parallel and tp == 1:
        return None
    return constraints.sequence_parallel


def candidate_layout(
    constraints: Constraints,
    sizes: tuple[int, int, int, int],
    zero_stage: int,
    activation_checkpointing: str,
    mixed_precision: str,
    sequence_length: int,
    sharding_plans: Mapping[bool, ShardingPlan | None],
) -> ParallelChoices | None:
    """The choices of the candidate ``sizes = (tp, pp, dp, ep)`` with one micro-batch of 1 (the
    caller replaces the batch and schedule fields), or ``None`` where no planner tries it: ZeRO
    over a single data-parallel rank unless the stage is constrained (it divides nothing), ZeRO-3
    under a pipeline (the runtime has none), ZeRO-2 without a pipeline unless the stage is
    constrained (below), or sequence parallelism asked for with ``tp`` 1.

    ZeRO-2 keeps the reduced gradients in the optimizer's shards and leaves ``.grad`` ``None``, so
    a loop's ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` clips nothing there; with
    ZeRO 0, 1 or 3 it clips by the single-device norm. ZeRO-2 saves the gradients' memory at ZeRO-1's
    speed, which ZeRO-3 saves too (predicted at most 1% slower on the Llama configurations
    measured), so the planner leaves it to a plan that asks for it, or to a pipeline, where torch's
    clip is per stage anyway and ZeRO-3 is not available. ``sharding_plans[sp]`` is the tensor-parallel
    plan with or without sequence parallelism.

    Example::

        layout = candidate_layout(Constraints(), (2, 1, 4, 1), 1, "none", "bf16", 2048, {True: plan})
        choices = dataclasses.replace(layout, micro_batch_size=2, num_microbatches=1)
    """
    tp, pp, dp, ep = sizes
    if zero_stage > 0 and dp == 1 and constraints.zero_stage is None:
        return None
    if zero_stage == 3 and pp > 1:  # vescale.parallelize refuses it: dpipe has no ZeRO-3
        return None
    if zero_stage == 2 and pp == 1 and constraints.zero_stage is None:
        return None
    sequence_parallel = sequence_parallel_for(constraints, tp)
    if sequence_parallel is None:
        return None
    return ParallelChoices(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        expert_parallel_size=ep,
        sequence_parallel=sequence_parallel,
        zero_stage=zero_stage,
        sequence_length=sequence_length,
        mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing,
        sharding_plan=sharding_plans.get(sequence_parallel) if tp > 1 else None,
    )
