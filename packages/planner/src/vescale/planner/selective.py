"""What ``activation_checkpointing="selective"`` keeps for backward, and what it recomputes.

Selective checkpointing runs each repeated block under PyTorch's selective activation
checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with
:func:`selective_policy`: the outputs of the ops that are expensive to run again are kept,
everything else in the block is recomputed during backward from the block's input.

* kept: matrix multiplications (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``),
  attention kernels (SDPA's flash / memory-efficient / cuDNN / CPU kernels: output and
  log-sum-exp) and the reductions of tensor parallelism (``all_reduce``,
  ``reduce_scatter_tensor``), so that backward repeats no matmul and no reduction;
* recomputed: element-wise ops, normalisations, activations, rotary embeddings, softmax,
  dropout (with the same random numbers), views, and sequence parallelism's all-gathers (as
  Megatron-LM does, the gathered input is not kept: it is ``tp`` times the shard).

The planner counts the same ops in its meta-tensor profile (:mod:`vescale.planner.profile`),
and ``vescale.parallelize`` applies this policy, so the estimate and the run agree by
construction.

Example::

    from functools import partial
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context_fn = partial(create_selective_checkpoint_contexts, selective_policy)
    out = checkpoint(block, hidden, use_reentrant=False, context_fn=context_fn)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

__all__ = ["KEPT_COLLECTIVES", "KEPT_COMPUTE_OPS", "selective_policy"]


def _existing(namespace: Any, names: tuple[str, ...]) -> frozenset[Any]:
    """The ``default`` overloads of the ops among ``names`` that this PyTorch build has."""
    return frozenset(getattr(namespace, name).default for name in names if hasattr(namespace, name))


KEPT_COMPUTE_OPS = _existing(
    torch.ops.aten,
    (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ),
)
"""The matmul and attention-kernel ops whose outputs selective checkpointing keeps."""

KEPT_COLLECTIVES = _existing(torch.ops._c10d_functional, ("all_reduce", "reduce_scatter_tensor"))
"""The tensor-parallel reductions whose outputs selective checkpointing keeps."""


def selective_policy(
    context: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    """``MUST_SAVE`` for the kept ops (see the module docstring), ``PREFER_RECOMPUTE`` for the rest.

    Example::

        policy = selective_policy(None, torch.ops.aten.mm.default)
        assert policy == CheckpointPolicy.MUST_SAVE
    """
    if op in KEPT_COMPUTE_OPS or op in KEPT_COLLECTIVES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
