"""``print(plan)``: the choices of a :class:`~vescale.planner.plan.Plan`, its memory per device and
its predicted speed.

The functions read a plan's attributes only; this module does not import the ``Plan`` type, so
the type's module can use it without an import cycle.

Example::

    print(format_plan_table(plan))
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_plan_table"]

_GIB = 2**30


def _choices(plan: Any) -> list[tuple[str, str]]:
    tp, pp, dp, ep = plan.mesh_size("tp"), plan.mesh_size("pp"), plan.mesh_size("dp"), plan.mesh_size("ep")
    sharding = plan.sharding_plan
    if sharding is None:
        tensor_parallel = "off"
    else:
        tensor_parallel = (
            f"{tp} ({len(sharding.parameter)} parameter, {len(sharding.forward)} forward patterns)"
        )
    pipeline = plan.pipeline
    if pipeline is None:
        pipeline_text = "off"
    else:
        pipeline_text = f"{pp} stages, {pipeline.schedule}, split {pipeline.split_method}"
    zero = plan.data_parallel.zero_stage
    if ep == 1:
        experts = "off"
    else:
        inside = "experts split over tp too" if plan.experts_split_over_tp else "tp outside the experts"
        capacity = "dropless" if plan.capacity_factor is None else f"capacity factor {plan.capacity_factor:g}"
        experts = f"{ep} (1/{ep} of the experts per rank, {inside}, {capacity})"
    data_parallel = f"{dp}, ZeRO-{zero}" if zero else f"{dp}, ZeRO-0 (DDP)"
    if ep > 1:
        data_parallel += f"; non-expert parameters over dp x ep = {dp * ep}, batch split over dp x ep"
    accumulation = "" if pipeline is not None else " (gradient accumulation)"
    return [
        ("world size", str(plan.world_size)),
        ("mesh", "  ".join(f"{dim}={size}" for dim, size in plan.mesh)),
        ("tensor parallel", tensor_parallel),
        ("sequence parallel", "on" if plan.sequence_parallel else "off"),
        ("pipeline parallel", pipeline_text),
        ("expert parallel", experts),
        ("data parallel", data_parallel),
        ("mixed precision", plan.mixed_precision),
        ("global batch size", str(plan.global_batch_size)),
        ("micro-batch size", str(plan.micro_batch_size)),
        ("micro-batches per step", f"{plan.num_microbatches}{accumulation}"),
        ("sequence length", str(plan.sequence_length)),
        ("activation checkpointing", plan.activation_checkpointing),
    ]


def _memory(plan: Any) -> list[tuple[str, str]]:
    estimate = plan.memory_estimate
    if estimate is None:
        return [("estimate", "not computed")]
    rows = [
        (name.replace("_", " "), f"{value / _GIB:10.2f} GiB") for name, value in estimate.to_dict().items()
    ]
    budget = plan.memory_per_device_gb
    of_budget = f" of {budget:.2f} GiB" if budget is not None else ""
    rows.append(("total", f"{estimate.total / _GIB:10.2f} GiB{of_budget}"))
    return rows


def _performance(plan: Any) -> list[tuple[str, str]]:
    performance = plan.performance
    rows = [
        ("hardware", performance.hardware),
        ("step time", f"{performance.step_time_s:.4g} s"),
        (
            "tokens/s",
            f"{performance.tokens_per_s:,.0f} ({performance.tokens_per_s / plan.world_size:,.0f} per device)",
        ),
        ("model TFLOP/s per device", f"{performance.model_tflops_per_device:.1f}"),
        ("MFU", f"{100 * performance.mfu:.1f}%"),
    ]
    rows += [(f"  {name}", f"{seconds:.4g} s") for name, seconds in performance.breakdown]
    return rows


def format_plan_table(plan: Any) -> str:
    """Titled tables: the plan's choices, the estimated memory per device, the predicted speed.

    Example::

        text = format_plan_table(plan)   # what print(plan) shows
    """
    lines = []
    tables = [("vescale plan", _choices(plan)), ("memory per device (estimate)", _memory(plan))]
    if plan.performance is not None:
        tables.append(("predicted performance", _performance(plan)))
    for title, rows in tables:
        width = max(len(name) for name, _ in rows)
        lines.append(title)
        lines.append("-" * (width + 24))
        lines.extend(f"  {name:<{width}}  {value}" for name, value in rows)
    return "\n".join(lines)
