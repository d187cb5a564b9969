"""Sharding strategies of scaled-dot-product attention on CPU and its math path.

PyTorch shards the CUDA kernels (flash, efficient, cuDNN); on CPU,
``F.scaled_dot_product_attention`` calls ``_scaled_dot_product_flash_attention_for_cpu``
(and its backward), or ``_scaled_dot_product_attention_math`` when DTensor decomposes it.
Attention is independent per batch row and per head, so each op shards on the batch dim
(0) or the head dim (1) of query, key, value, outputs and gradients alike. Grouped-query
attention (fewer key/value heads than query heads) keeps head sharding valid only when the
key/value head count divides by the mesh size, since contiguous head chunks then pair each
query group with its key/value head; otherwise heads are not offered as a sharding dim.
An attention mask broadcast over a dim (size 1 there) stays Replicate.

Example::

    import vescale.dtensor.ops  # registers these strategies
    out = F.scaled_dot_product_attention(q_heads_sharded, k_heads_sharded, v_heads_sharded, is_causal=True)
    assert out.placements == (Shard(1),)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = [
    "sdpa_flash_for_cpu_backward_strategy",
    "sdpa_flash_for_cpu_strategy",
    "sdpa_math_strategy",
]

aten = torch.ops.aten

# Batch (dim 0) and heads (dim 1) of (batch, heads, seq, head_dim) attention tensors.
_INDEPENDENT_DIMS = (0, 1)


def _shard_unless_broadcast(spec: Any, dim: int) -> Placement:
    """``Shard(dim)`` for a mask that varies along ``dim``, Replicate for one broadcast there."""
    return Shard(dim) if spec.shape[dim] > 1 else Replicate()


def _heads_shard_evenly(query: Any, key: Any) -> bool:
    """Whether chunking the head dim pairs every query head with its key/value head."""
    query_heads, key_heads = query.shape[1], key.shape[1]
    # The mesh of the specs, in full: a conservative bound for head sharding on any of its dims.
    return query_heads == key_heads or key_heads % key.mesh.size() == 0


def _attention_strategies(
    num_outputs: int, num_attention_tensors: int, mask: Any | None, query: Any, key: Any
) -> list[tuple[list[Placement], list[Placement]]]:
    """All Replicate, and one strategy per independent dim sharding every tensor on it."""
    mask_count = 0 if mask is None else 1
    strategies = [([Replicate()] * num_outputs, [Replicate()] * (num_attention_tensors + mask_count))]
    dims = _INDEPENDENT_DIMS if _heads_shard_evenly(query, key) else (0,)
    for dim in dims:
        inputs: list[Placement] = [Shard(dim)] * num_attention_tensors
        if mask is not None:
            inputs.append(_shard_unless_broadcast(mask, dim))
        strategies.append(([Shard(dim)] * num_outputs, inputs))
    return strategies


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_flash_for_cpu_strategy(
    query: Any,
    key: Any,
    value: Any,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Any | None = None,
    scale: float | None = None,
) -> list[tuple[list[Placement], list[Placement]]]:
    """(output, logsumexp) from (query, key, value[, attn_mask]), sharded by batch or head.

    Example::

        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
        assert out.placements == q.placements
    """
    return _attention_strategies(2, 3, attn_mask, query, key)


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_flash_for_cpu_backward_strategy(
    grad_out: Any,
    query: Any,
    key: Any,
    value: Any,
    out: Any,
    logsumexp: Any,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Any | None = None,
    scale: float | None = None,
) -> list[tuple[list[Placement], list[Placement]]]:
    """(grad_query, grad_key, grad_value) from grad_out, q, k, v, out, logsumexp[, attn_mask].

    Example::

        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, logsumexp, 0.0, True)
    """
    return _attention_strategies(3, 6, attn_mask, query, key)


@register_sharding(aten._scaled_dot_product_attention_math.default)
def sdpa_math_strategy(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    dropout_mask: Any | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> list[tuple[list[Placement], list[Placement]]]:
    """(output, attention weights) of the math path, sharded by batch or head.

    Example::

        out, weights = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True)
        assert weights.placements == q.placements
    """
    if dropout_mask is not None:
        # A dropout mask drawn for the full tensor cannot be split consistently here.
        return [([Replicate()] * 2, [Replicate()] * (4 if attn_mask is None else 5))]
    return _attention_strategies(2, 3, attn_mask, query, key)
