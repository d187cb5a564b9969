"""The reason behind each choice of ``generate_plan``, as ``Plan.explain()`` prints it.

Example::

    reasons = explain_choices(constraints, choices, estimate, budget_gib, devices_per_node)
"""

from __future__ import annotations

from vescale.planner.constraints import Constraints
from vescale.planner.memory import MemoryEstimate, ParallelChoices

__all__ = ["explain_choices"]

_GIB = 2**30


def explain_choices(
    constraints: Constraints,
    choices: ParallelChoices,
    estimate: MemoryEstimate,
    budget_gib: float,
    devices_per_node: int,
) -> dict[str, str]:
    """Choice name -> why, for the choices ``generate_plan`` settled on.

    Example::

        explain_choices(Constraints(), ParallelChoices(), estimate, 80.0, 8)["tensor_parallel"]
    """
    tp, pp, dp = choices.tensor_parallel_size, choices.pipeline_parallel_size, choices.data_parallel_size
    fits = f"{estimate.total / _GIB:.2f} GiB per device fits memory_per_device_gb={budget_gib:.2f}"

    def given(field_name: str, otherwise: str) -> str:
        return "constraint" if getattr(constraints, field_name) is not None else otherwise

    model_parallel = (
        f"the smallest model-parallel size (tp x pp = {tp * pp}) whose estimate fits ({fits}); "
        f"tensor parallelism within a node ({devices_per_node} devices), pipeline across nodes"
    )
    return {
        "tensor_parallel": given("tensor_parallel_size", model_parallel),
        "pipeline_parallel": given("pipeline_parallel_size", model_parallel),
        "data_parallel": given(
            "data_parallel_size",
            f"the rest of the world: {dp} = world / (tp x pp"
            + (" x ep)" if choices.expert_parallel_size > 1 else ")"),
        ),
        "expert_parallel": given(
            "expert_parallel_size",
            f"{choices.expert_parallel_size}: the smallest ep size (1/ep of each experts module per rank, "
            f"tokens sent to their experts by all-to-all) with which the plan fits ({fits})"
            if choices.expert_parallel_size > 1
            else "1: the experts (if any) fit replicated, or the world does not split them",
        ),
        "sequence_parallel": given(
            "sequence_parallel",
            "on with tensor parallelism: it divides the norms' activations too"
            if choices.sequence_parallel
            else "off: no tensor parallelism to shard the sequence over",
        ),
        "zero_stage": given(
            "zero_stage",
            f"the lowest ZeRO stage that fits ({fits}); ZeRO-2 only under a pipeline, as with it "
            "torch.nn.utils.clip_grad_norm_ sees no gradients",
        ),
        "activation_checkpointing": given(
            "activation_checkpointing",
            {
                "none": "none: it fits without recomputation",
                "selective": "selective: it does not fit without recomputation, but fits keeping each "
                "block's matmul and attention outputs (backward recomputes no matmul)",
                "full": "full: nothing fits without recomputing each block whole",
            }[choices.activation_checkpointing],
        ),
        "mixed_precision": given("mixed_precision", "fp32: the default (bf16 only when asked)"),
        "micro_batching": (
            f"{choices.num_microbatches} micro-batch(es) of {choices.micro_batch_size} per dp rank: "
            + given("global_batch_size", "global batch = dp x micro-batch when not given")
        ),
    }
