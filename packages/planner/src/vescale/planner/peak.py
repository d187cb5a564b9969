"""The peak moment of one training step of a pipeline stage, and what each part holds at it.

A rank's memory does not hold every part at once: activations are freed as backward runs
while gradients appear, and the optimizer step runs after the activations are gone. The
peak is the largest of three moments (all sizes are bytes on one device):

* **start of backward**: parameters, optimizer state, the activations the forward kept (on a
  pipeline's last stage with every micro-batch's logits, which ``vescale.dpipe`` keeps to
  return them, through the optimizer step too), and
  the gradients already held then: all of them where data parallelism keeps persistent
  gradient buckets (ZeRO-0/1, ``dp > 1``), one full bucket being filled under ZeRO-2, else
  only the gradients of the head side (the first produced); with several micro-batches per
  step (gradient accumulation, or a pipeline's micro-batches), every gradient the rank keeps
  (plus ZeRO-2's bucket being filled), accumulated by the earlier micro-batches. Temporaries: the loss's
  gradient buffers (two tensors the size of the model's largest output, the logits: the
  gradient of the log-probabilities and of the logits), or under full activation
  checkpointing the recomputed block when that is larger; under ZeRO-3 FSDP2's unsharded
  parameters of the root module (embedding, head, final norm: not resharded after forward)
  and of the block being computed; under expert parallelism, after the loss's gradients, one
  MoE layer's all-to-all buffers (beside the recomputed block);
* **end of backward** (backward reaching the first block): every gradient this rank keeps
  (``1/dp`` under ZeRO-2/3, plus ZeRO-2's buckets in flight), the first block's activations
  (recomputed under full checkpointing) and the stage's first side; under ZeRO-3 the root,
  the block being computed, the next one FSDP2 prefetched and one block's unsharded gradients
  before their reduce-scatter; under expert parallelism one MoE layer's all-to-all buffers;
* **optimizer step**: no activations but a pipeline's kept logits; temporaries are the larger
  of the optimizer's per-tensor buffers (two tensors the size of the largest stepped tensor:
  AdamW's ``denom`` and its square root) and, under ZeRO-1/2, the buffers of the parameter all-gather as
  ``vescale.doptim`` publishes the stepped parameters: at most ``MAX_GATHERS_IN_FLIGHT`` (2)
  full buckets gathered at once, each with this rank's chunk of it (``1/dp``); none where it
  publishes by in-place broadcasts (``publish_in_place``: gloo, CPU ranks).

Not modelled: allocator caching and fragmentation (on CPU they are glibc's; the benchmark
fixes its mmap threshold so that freed tensors leave the resident set, see
``tools/bench/plan_memory.py``), the process group's and library's one-time buffers.

Example::

    estimate = peak_estimate(sizes, ParallelChoices(data_parallel_size=2, zero_stage=1))
    print(estimate.temporaries / 2**20, "MiB of short-lived buffers at the peak")
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from vescale.doptim.ddp import DDP, MAX_BUCKETS_IN_FLIGHT
from vescale.doptim.zero import MAX_GATHERS_IN_FLIGHT

__all__ = ["DEFAULT_BUCKET_BYTES", "StageSizes", "peak_moments"]

# doptim's DDP buckets gradients in buffers of this size unless told otherwise.
DEFAULT_BUCKET_BYTES = int(inspect.signature(DDP.__init__).parameters["bucket_size_mb"].default * 2**20)


@dataclass(frozen=True)
class StageSizes:
    """What one device of a stage holds before ZeRO divides it (bytes, after tensor parallelism).

    Example::

        StageSizes(parameters=4e6, outside_parameters=1e6, head_parameters=5e5,
                   largest_block_parameters=1e6, largest_parameter=5e5, optimizer_states=8e6,
                   activations=3e6, last_activations=1e6, loss_gradients=1e6, recompute=0)
    """

    parameters: float
    outside_parameters: float  # outside the repeated blocks (FSDP2's root unit)
    head_parameters: float  # after the blocks: their gradients come first in backward
    largest_block_parameters: float
    largest_parameter: float
    optimizer_states: float  # already divided by dp where ZeRO divides it
    activations: float  # what the forward keeps for backward
    last_activations: float  # kept when backward reaches the first block: that block's and the first side's
    loss_gradients: float
    recompute: float  # under full checkpointing: a recomputed block beyond the head's activations
    # Under expert parallelism: one MoE layer's all-to-all send and receive buffers, alive while the
    # layer runs (in backward too: the transposed all-to-alls of its gradients).
    dispatch_buffers: float = 0.0
    # A pipeline's last stage: the logits of the micro-batches not in flight, which vescale.dpipe
    # keeps from their forward to the next step to return them.
    kept_outputs: float = 0.0


def peak_moments(
    sizes: StageSizes,
    data_parallel_size: float,
    zero_stage: int,
    *,
    num_microbatches: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    publish_in_place: bool = False,
) -> dict[str, tuple[float, float, float, float, float]]:
    """``{moment: (parameters, gradients, optimizer_states, activations, temporaries)}`` (module docstring).

    ``data_parallel_size`` is what ZeRO divides the parameters by: the dp size, or under expert
    parallelism an equivalent non-integer divisor (:mod:`vescale.planner.memory`).
    ``publish_in_place``: ZeRO-1/2 publish the stepped parameters by in-place broadcasts (as
    ``vescale.doptim`` does on gloo), with no gather buffers.

    Example::

        moments = peak_moments(sizes, data_parallel_size=2, zero_stage=1)
        peak = max(moments.values(), key=sum)
    """
    dp, zero, whole = data_parallel_size, zero_stage, sizes.parameters
    parameters = whole / dp if zero == 3 else whole
    bucket = min(whole, bucket_bytes)
    kept_gradients = whole / dp if zero >= 2 else whole
    if dp > 1 and zero < 2:
        first_gradients = whole  # the buckets persist from step to step
    elif zero == 2:
        first_gradients = bucket
    else:
        first_gradients = sizes.head_parameters / (dp if zero == 3 else 1)
    if num_microbatches > 1:
        # A later micro-batch starts its backward with the gradients the earlier ones accumulated.
        first_gradients = min(whole, kept_gradients + (bucket if zero == 2 else 0.0))
    in_flight = min(whole - kept_gradients, MAX_BUCKETS_IN_FLIGHT * bucket) if zero == 2 else 0.0
    unsharded = sizes.outside_parameters + sizes.largest_block_parameters if zero == 3 else 0.0
    # Deep in backward FSDP2 also holds the next block it prefetched and a block's unsharded gradients.
    unsharded_in_backward = unsharded + 2 * sizes.largest_block_parameters if zero == 3 else 0.0
    # ZeRO-1/2's publish: the buckets gathered at once, each beside this rank's chunk of it.
    gathered = min(whole, MAX_GATHERS_IN_FLIGHT * bucket)
    gathers = dp > 1 and zero in (1, 2) and not publish_in_place
    all_gather = gathered + gathered / dp if gathers else 0.0
    stepped = sizes.largest_parameter / (dp if zero >= 1 else 1)
    state = sizes.optimizer_states
    return {
        "start of backward": (
            parameters,
            first_gradients,
            state,
            sizes.activations + sizes.kept_outputs,
            unsharded + max(sizes.loss_gradients, sizes.recompute + sizes.dispatch_buffers),
        ),
        "end of backward": (
            parameters,
            kept_gradients + in_flight,
            state,
            sizes.last_activations + sizes.kept_outputs,
            unsharded_in_backward + sizes.dispatch_buffers,
        ),
        "optimizer step": (
            parameters,
            kept_gradients,
            state,
            sizes.kept_outputs,
            max(2 * stepped, all_gather),
        ),
    }
