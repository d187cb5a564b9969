"""The step-time model: seconds per optimizer step of a plan on a hardware profile, by part.

From the per-op records of the meta-tensor forward (:mod:`vescale.planner.op_costs`):

* **compute**: each matmul ``max(flops / (peak * e(d)), bytes / bandwidth) + overhead`` with the
  efficiency curve ``e(d) = matmul_efficiency * d / (d + matmul_half_dim)`` on its smallest
  dimension ``d`` after tensor parallelism (column-parallel divides ``n``, row-parallel ``k``);
  fused attention likewise on its head dimension (heads divided by ``tp``), with the profile's
  own attention curve where it has one (CPU: the fused kernel lags the matmul); every other op
  ``bytes / (memory bandwidth * memory_efficiency)``; each op at least ``op_overhead_us``
  (``dtensor_op_overhead_us`` under tensor parallelism, where every op runs on DTensors).
  Backward costs 2x the forward (attention 2.5x), in ``mixed_precision``'s dtype;
* **recompute**: ``"full"`` runs each block's forward again, ``"selective"`` its non-matmul ops;
* **tensor_parallel**: each row-parallel output all-reduced in forward and backward (under
  sequence parallelism a reduce-scatter and an all-gather: the same ring volume, unless the
  backend runs a reduce-scatter as a whole all-reduce, as gloo does), each collective plus
  the host time of the DTensor redistribution around it (``redistribute_overhead_us``);
* **pipeline_bubble**: ``(p - 1) / v`` micro-batch slots of the slowest stage for GPipe and
  1F1B (``v = 1``) and interleaved 1F1B (``v`` virtual stages), a third of 1F1B's for zero-bubble;
  where ``r`` ranks share a core (CPU ranks outnumbering the cores) the ramp's idle ranks' cores
  run the computing ones faster, so only ``(2 sum_j max(1/r, j/p) - (p-1)) / (p-1)`` of it shows
  (``j = 1 .. p-1``; all of it at ``r = 1``, none at ``r >= p``);
  **pipeline_p2p**: two activation sends per micro-batch;
* **data_parallel**: what the runtime does not hide: the gradient all-reduce (ZeRO-0/1) or
  reduce-scatter (ZeRO-2; an in-place all-reduce where that is cheaper, as on gloo, whose
  reduce-scatter all-reduces a copy) beyond the last micro-batch's backward it overlaps with
  (all of it under a pipeline, which reduces a stage's gradients after the schedule), plus
  ZeRO-1/2's parameter publish after the step (an all-gather; on gloo one in-place broadcast
  per chunk owner, at the profile's ``zero_publish_factor``); ZeRO-3's per-block all-gathers and
  reduce-scatters beyond the block compute they are prefetched under (every micro-batch;
  under a pipeline once per step, as FSDP2 keeps a stage gathered across micro-batches; all
  of it where the profile says communication does not overlap, as on CPU ranks); plus the
  global-batch loss's scalar all-reduces over the batch ranks, one per step with one piece per
  rank or under a pipeline, two with micro-batches, latency-bound and on the critical path;
* **expert_parallel** (``ep > 1``): per micro-batch and MoE layer of the stage, four all-to-alls
  of the layer's ``tokens x top_k`` hidden states over the ``ep`` axis (dispatch and combine in
  forward, their transposes in backward; six under full recomputation), each rank keeping
  ``1/ep`` of them; each rank computes E/ep experts on as many rows as it sends (balanced
  routing), so compute is unchanged, and its parameters are E/ep of the experts' plus the rest;
  gradients are reduced over the batch ranks ``dp x ep`` (the experts' over ``dp`` only: their
  traffic is counted on the wider ring, an overestimate);
* **optimizer**: AdamW reads and writes ~28 bytes per local fp32 element (32 with bf16
  masters), memory-bound, plus the host time of its per-tensor loop per parameter tensor
  (:meth:`HardwareProfile.optimizer_tensor_seconds`; 0 on CUDA's multi-tensor kernels).

Collectives are alpha-beta rings on the links their axis spans (:mod:`._collectives`), each
plus the profile's wait for its last member (ranks sharing cores arrive a time slice apart). Model
FLOPs (for MFU) are 3x the forward's matmul and full attention FLOPs: no recomputation.

Example::

    cost = predict_step(profile, choices, load_hardware("h100-80gb"))
    print(cost.step_time_s, cost.breakdown)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vescale.planner._collectives import (
    AxisLink,
    all_gather_seconds,
    all_reduce_seconds,
    all_to_all_seconds,
    axis_link,
    p2p_seconds,
    reduce_scatter_seconds,
    zero_publish_seconds,
)
from vescale.planner.errors import PlanError
from vescale.planner.hardware import HardwareProfile
from vescale.planner.memory import _EXPERT_PARAMETER, ParallelChoices, _column_input, _tp_sharded
from vescale.planner.op_costs import OpCost
from vescale.planner.profile import ModelProfile

__all__ = ["StepCost", "balanced_split", "model_flops_per_step", "op_parts", "predict_step"]

_BACKWARD = {"matmul": 2.0, "attention": 2.5, "memory": 2.0}
_ADAMW_BYTES = {"fp32": 28.0, "bf16": 32.0}
# vescale.parallelize's global-batch loss: all-reduces of a few float64 scalars over the batch
# ranks per step: one after the forward (the loss-term count with the loss) for one piece per
# rank, the count before the first and the loss after the last of several micro-batches (under
# a pipeline only the count bounds).
_LOSS_REDUCTION_BYTES = 16.0


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one optimizer step, by part (they add up to ``step_time_s``)."""

    step_time_s: float
    breakdown: tuple[tuple[str, float], ...]
    model_flops: float


@dataclass
class _Part:
    forward: float = 0.0  # compute seconds of one micro-batch's forward
    backward: float = 0.0
    memory_forward: float = 0.0  # of which memory-bound ops (what selective recomputes)
    tp_forward: float = 0.0  # tensor-parallel communication, forward
    parameter_elements: float = 0.0  # local elements after tensor and expert parallelism
    parameter_tensors: int = 0
    routes_tokens: bool = False  # an MoE layer: its tokens cross the ep axis by all-to-all


def _op_seconds(
    op: OpCost,
    choices: ParallelChoices,
    hardware: HardwareProfile,
    scale: float,
    profile: ModelProfile,
    block_fqns: frozenset[str],
) -> tuple[float, float]:
    """``(forward seconds, tp all-reduce bytes)`` of one op on one tensor-parallel rank."""
    tp, plan = choices.tensor_parallel_size, choices.sharding_plan
    bytes_scale = 0.5 if choices.mixed_precision == "bf16" else 1.0
    traffic = op.traffic_bytes * scale * bytes_scale
    bandwidth = hardware.memory_bandwidth * hardware.memory_efficiency
    # Under tensor parallelism every op of the model runs on DTensors (implicit replication).
    overhead = (hardware.dtensor_op_overhead_us if tp > 1 else hardware.op_overhead_us) * 1e-6
    sharded = column = False
    if tp > 1 and plan is not None and op.module_fqn:
        owned = profile.module_parameters.get(op.module_fqn, ())
        sharded = any(_tp_sharded(plan, fqn) for fqn in owned)
        column = sharded and _column_input(plan, op.module_fqn)
    if op.kind == "memory":
        divisor = 1
        if tp > 1 and op.block is not None:
            # The block's own ops (residual adds) and norms run on whole activations unless SP shards them.
            whole = op.module_fqn in block_fqns or (
                op.module_fqn in profile.module_parameters and not sharded
            )
            divisor = tp if (not whole or choices.sequence_parallel) else 1
        return max(traffic / divisor / bandwidth, overhead), 0.0
    peak = hardware.peak_flops(choices.mixed_precision)
    m: float
    smallest: float
    n: float
    k: float
    m, n, k = op.dims
    flops = op.flops * scale
    reduce_bytes = 0.0
    efficiency_at_scale, half_dim = hardware.matmul_efficiency, hardware.matmul_half_dim
    if op.kind == "attention":
        divisor = tp if tp > 1 and op.block is not None else 1
        smallest = k
        efficiency_at_scale, half_dim = hardware.attention_curve()
    else:
        divisor = tp if sharded else 1
        m = m * scale
        if sharded and column:
            n = n / tp
        elif sharded:
            k = k / tp
            reduce_bytes = op.output_bytes * scale * bytes_scale
        smallest = min(m, n, k)
    efficiency = efficiency_at_scale * smallest / (smallest + half_dim)
    seconds = max(flops / divisor / (peak * efficiency), traffic / divisor / bandwidth)
    return max(seconds + hardware.matmul_overhead_us * 1e-6, overhead), reduce_bytes


def op_parts(
    profile: ModelProfile, choices: ParallelChoices, hardware: HardwareProfile
) -> dict[int | str, _Part]:
    """Block index (or ``"first"``/``"last"`` for the outside sides) -> its per-micro-batch times.

    Depends only on ``tp``, ``ep``, sequence parallelism, mixed precision, the sharding plan and
    the micro-batch size of ``choices``: a search computes it once per such key and passes it to
    :func:`predict_step` and :func:`balanced_split`.
    """
    scale = choices.micro_batch_size / profile.micro_batch_size
    shortest: dict[int, str] = {}
    for op in profile.op_costs:
        if op.block is not None and len(op.module_fqn) < len(shortest.get(op.block, op.module_fqn + "_")):
            shortest[op.block] = op.module_fqn
    block_fqns = frozenset(shortest.values())
    tp_link = axis_link(hardware, choices.tensor_parallel_size, 1)
    redistribute_overhead = hardware.redistribute_overhead_us * 1e-6 if tp_link.size > 1 else 0.0
    parts: dict[int | str, _Part] = {}
    for op in profile.op_costs:
        key = op.block if op.block is not None else op.side
        part = parts.setdefault(key, _Part())
        seconds, reduce_bytes = _op_seconds(op, choices, hardware, scale, profile, block_fqns)
        part.forward += seconds
        part.backward += _BACKWARD[op.kind] * seconds
        part.memory_forward += seconds if op.kind == "memory" else 0.0
        if reduce_bytes <= 0:
            continue
        if choices.sequence_parallel:
            # A reduce-scatter out of the row-parallel op, an all-gather into the next one.
            part.tp_forward += (
                reduce_scatter_seconds(tp_link, reduce_bytes)
                + all_gather_seconds(tp_link, reduce_bytes)
                + 2 * redistribute_overhead
            )
        else:
            part.tp_forward += all_reduce_seconds(tp_link, reduce_bytes) + redistribute_overhead
    tp, plan = choices.tensor_parallel_size, choices.sharding_plan
    for record in profile.parameters:
        key = record.block if record.block is not None else record.side
        if tp > 1 and plan is None:
            raise PlanError(
                f"tensor_parallel_size={tp} but the choices carry no sharding_plan to cost parameter "
                f"{record.fqn!r} with; give ParallelChoices the tensor-parallel plan"
            )
        if _EXPERT_PARAMETER.search(record.fqn):
            parts.setdefault(key, _Part()).routes_tokens = True
            local = record.numel / choices.expert_parallel_size  # tensor parallelism stays outside
        else:
            local = record.numel / (
                tp if plan is not None and tp > 1 and _tp_sharded(plan, record.fqn) else 1
            )
        parts.setdefault(key, _Part()).parameter_elements += local
        parts[key].parameter_tensors += 1
    return parts


def model_flops_per_step(profile: ModelProfile, global_batch_size: int) -> float:
    """Forward + backward FLOPs of the model for one step (3x forward; attention counted full).

    Example::

        model_flops_per_step(profile, 1024) / (1024 * profile.sequence_length)   # ~ 6 N + attention
    """
    forward = sum(
        op.flops * (2.0 if op.kind == "attention" else 1.0) for op in profile.op_costs if op.kind != "memory"
    )
    return 3.0 * forward * global_batch_size / profile.micro_batch_size


def balanced_split(
    profile: ModelProfile,
    choices: ParallelChoices,
    hardware: HardwareProfile,
    parts: dict[int | str, _Part] | None = None,
) -> tuple[int, ...]:
    """The first block of each pipeline stage after the first, minimising the slowest stage's
    forward + backward time over contiguous block ranges (the embedding side counts on the first
    stage, the head side on the last): the optimum's bottleneck is bisected, each limit checked
    by a greedy packing, which is exact for contiguous partitions.

    Example::

        balanced_split(profile, ParallelChoices(pipeline_parallel_size=4), h100)   # (9, 17, 25)
    """
    pp, blocks = choices.pipeline_parallel_size, profile.num_blocks
    if pp == 1 or blocks < pp:
        return ()
    parts = parts if parts is not None else op_parts(profile, choices, hardware)
    times = [parts[b].forward + parts[b].backward if b in parts else 0.0 for b in range(blocks)]
    first = parts.get("first", _Part())
    last = parts.get("last", _Part())
    prefix = [0.0]
    for seconds in times:
        prefix.append(prefix[-1] + seconds)

    def stage(start: int, stop: int) -> float:
        extra = (first.forward + first.backward if start == 0 else 0.0) + (
            last.forward + last.backward if stop == blocks else 0.0
        )
        return prefix[stop] - prefix[start] + extra

    def pack(limit: float) -> list[int] | None:
        """Greedy cuts whose stages all take at most ``limit``, each stage at least one block."""
        starts, begin = [], 0
        for index in range(pp):
            stop = begin + 1
            if index == pp - 1:
                stop = blocks
            while stop < blocks - (pp - index - 1) and stage(begin, stop + 1) <= limit:
                stop += 1
            if stage(begin, stop) > limit:
                return None
            starts.append(begin)
            begin = stop
        return starts

    # Bisect the slowest stage's time: the smallest limit the greedy packing meets.
    low, high = 0.0, stage(0, blocks)
    best = pack(high) or [round(i * blocks / pp) for i in range(pp)]
    for _ in range(60):
        middle = (low + high) / 2
        packed = pack(middle)
        if packed is None:
            low = middle
        else:
            high, best = middle, packed
    return tuple(best[1:])


def _stage_blocks(num_blocks: int, pp: int, split: tuple[int, ...] | None) -> list[range]:
    if split:
        bounds = [0, *split, num_blocks]
        return [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    per_stage = math.ceil(num_blocks / pp) if num_blocks else 0
    return [range(min(s * per_stage, num_blocks), min((s + 1) * per_stage, num_blocks)) for s in range(pp)]


def predict_step(
    profile: ModelProfile,
    choices: ParallelChoices,
    hardware: HardwareProfile,
    *,
    virtual_stages: int = 1,
    devices_per_node: int | None = None,
    stage_split: tuple[int, ...] | None = None,
    parts: dict[int | str, _Part] | None = None,
) -> StepCost:
    """The step time of ``choices`` (module docstring); ``stage_split`` gives the first block of each
    pipeline stage after the first (default: ``ceil(blocks / pp)`` per stage).

    Example::

        predict_step(profile, ParallelChoices(data_parallel_size=8, zero_stage=3,
                     mixed_precision="bf16", sequence_length=8192), load_hardware("h100-80gb"))
    """
    tp, pp, dp = choices.tensor_parallel_size, choices.pipeline_parallel_size, choices.data_parallel_size
    per_node = devices_per_node or hardware.devices_per_node
    parts = parts if parts is not None else op_parts(profile, choices, hardware)
    recompute = choices.activation_checkpointing
    microbatches = choices.num_microbatches
    ep = choices.expert_parallel_size
    # Gradients are reduced over the batch ranks: dp x ep (canonical order pp, dp, ep, tp).
    dp_link = axis_link(hardware, dp * ep, tp, per_node)
    ep_link = axis_link(hardware, ep, tp, per_node)
    pp_link = axis_link(hardware, pp, tp * dp * ep, per_node)
    activation_bytes = profile.block_input_bytes * choices.micro_batch_size / profile.micro_batch_size
    activation_bytes *= 0.5 if choices.mixed_precision == "bf16" else 1.0
    all_to_alls = 6 if recompute == "full" else 4
    grad_bytes = 2.0 if choices.mixed_precision == "bf16" else 4.0
    worst: tuple[float, dict[str, float]] | None = None
    for index, blocks in enumerate(_stage_blocks(profile.num_blocks, pp, stage_split)):
        members = [parts[b] for b in blocks if b in parts]
        if index == 0:
            members.append(parts.get("first", _Part()))
        if index == pp - 1:
            members.append(parts.get("last", _Part()))
        compute = sum(p.forward + p.backward for p in members)
        block_members = [parts[b] for b in blocks if b in parts]
        rerun = {"full": sum(p.forward for p in block_members), "selective": 0.0, "none": 0.0}[recompute]
        if recompute == "selective":
            rerun = sum(p.memory_forward for p in block_members)
        tensor_parallel = sum(p.tp_forward for p in members) * (3.0 if recompute == "full" else 2.0)
        slot = compute + rerun + tensor_parallel
        elements = sum(p.parameter_elements for p in members)
        data_parallel = _data_parallel_seconds(
            choices,
            dp_link,
            elements,
            grad_bytes,
            block_members,
            members,
            microbatches,
            hardware.overlaps_communication,
        ) + (1 if pp > 1 or microbatches == 1 else 2) * all_reduce_seconds(dp_link, _LOSS_REDUCTION_BYTES)
        local = elements / (dp * ep if choices.zero_stage >= 1 else 1)
        # Memory-bound, plus the host time of AdamW's per-tensor loop where it has one (CPU). It
        # steps DTensors only under ZeRO-3 (FSDP2's shards): vescale.doptim gives it plain local
        # master tensors under ZeRO-0-2, tensor parallel or not.
        tensors = sum(p.parameter_tensors for p in members)
        optimizer = local * _ADAMW_BYTES[choices.mixed_precision] / (
            hardware.memory_bandwidth * hardware.memory_efficiency
        ) + tensors * hardware.optimizer_tensor_seconds(dtensor=choices.zero_stage == 3)
        parts_of_stage = {
            "compute": microbatches * compute,
            "recompute": microbatches * rerun,
            "tensor_parallel": microbatches * tensor_parallel,
            "pipeline_bubble": _bubble_slots(choices.schedule, pp, virtual_stages)
            * slot
            * _bubble_share(hardware.ranks_per_core, pp),
            "pipeline_p2p": 0.0,
            "data_parallel": data_parallel,
            "optimizer": optimizer,
        }
        if ep > 1:
            routed = sum(1 for part in block_members if part.routes_tokens)
            dispatch = all_to_all_seconds(ep_link, activation_bytes * profile.expert_top_k)
            parts_of_stage["expert_parallel"] = microbatches * routed * all_to_alls * dispatch
        if pp > 1:
            activation = activation_bytes / (tp if choices.sequence_parallel else 1)
            parts_of_stage["pipeline_p2p"] = (
                2 * microbatches * virtual_stages * p2p_seconds(pp_link, activation)
            )
        total = sum(parts_of_stage.values())
        if worst is None or total > worst[0]:
            worst = (total, parts_of_stage)
    if worst is None:
        raise PlanError(f"pipeline_parallel_size={pp} gives no stage to cost; use a size of at least 1")
    total, breakdown = worst
    global_batch = microbatches * dp * ep * choices.micro_batch_size
    return StepCost(total, tuple(breakdown.items()), model_flops_per_step(profile, global_batch))


def _bubble_slots(schedule: str, pp: int, virtual_stages: int) -> float:
    if pp == 1:
        return 0.0
    if schedule in ("zero_bubble", "zbv"):
        # A third of 1F1B's ramp, in slots of one stage's work: v stages per rank shorten each.
        return (pp - 1) / (3.0 * virtual_stages)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / virtual_stages
    return float(pp - 1)


def _bubble_share(ranks_per_core: float, pp: int) -> float:
    """The share of a pipeline's bubble that shows where ``ranks_per_core`` ranks share each core.

    The ramp of ``p`` stages has ``p - 1`` slots in which ``j = 1 .. p-1`` stages compute (and as
    many as it drains): those ranks get the idle ranks' cores, up to one each, so they run
    ``min(r, p / j)`` times faster than when every rank computes. The step is then
    ``2 sum_j max(1/r, j/p) - (p - 1)`` slots longer than its compute instead of ``p - 1``:
    all of the bubble at ``r = 1`` (a device a rank), none at ``r >= p``.
    """
    if pp == 1 or ranks_per_core <= 1:
        return 1.0
    ramp = sum(max(1 / ranks_per_core, j / pp) for j in range(1, pp))
    return (2 * ramp - (pp - 1)) / (pp - 1)


def _data_parallel_seconds(
    choices: ParallelChoices,
    link: AxisLink,
    elements: float,
    grad_bytes: float,
    block_members: list[_Part],
    members: list[_Part],
    microbatches: int,
    overlaps: bool = True,
) -> float:
    """Exposed data-parallel communication of one stage per step (module docstring)."""
    if link.size == 1:
        return 0.0
    zero = choices.zero_stage
    parameter_bytes = elements * grad_bytes
    last_backward = sum(p.backward for p in members)
    if zero < 3:
        gradients = all_reduce_seconds(link, parameter_bytes)
        if zero == 2:
            # Reduce-scattered, or all-reduced in place where the backend's reduce-scatter is an
            # all-reduce of a copy (gloo): vescale.doptim takes the cheaper.
            gradients = min(gradients, reduce_scatter_seconds(link, parameter_bytes))
        if choices.pipeline_parallel_size > 1:
            # vescale.dpipe holds the reduction back through the schedule (DDP's no_sync) and
            # reduces each gradient once after it: no backward is left to hide it under.
            exposed = gradients
        else:
            bucket_share = min(1.0, 25 * 2**20 / max(parameter_bytes, 1.0))
            exposed = max(gradients - last_backward, gradients * bucket_share)
        if zero >= 1:
            exposed += zero_publish_seconds(link, parameter_bytes)
        return exposed
    # Under a pipeline FSDP2 keeps a stage's parameters gathered across its micro-batches and
    # reduce-scatters once, at the last backward (torch.distributed.pipelining's data-parallel mode).
    rounds = 1 if choices.pipeline_parallel_size > 1 else microbatches
    exposed = 0.0
    for part in block_members:
        gather = all_gather_seconds(link, part.parameter_elements * grad_bytes)
        scatter = reduce_scatter_seconds(link, part.parameter_elements * grad_bytes)
        # Backward gathers the block again, unless a pipeline keeps it gathered, and reduce-scatters.
        backward_traffic = scatter if choices.pipeline_parallel_size > 1 else gather + scatter
        if not overlaps:  # no streams to prefetch on: every gather and reduce-scatter waits
            exposed += gather + backward_traffic
            continue
        exposed += max(0.0, gather - part.forward) + max(0.0, backward_traffic - part.backward)
    outside = sum(p.parameter_elements for p in members) - sum(p.parameter_elements for p in block_members)
    largest_block = max((p.parameter_elements for p in block_members), default=0.0)
    first_gather = all_gather_seconds(link, (outside + largest_block) * grad_bytes)
    return rounds * (exposed + 2 * first_gather)
