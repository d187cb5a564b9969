"""Sharding strategies of scaled-dot-product attention on CPU and its math path.

PyTorch shards the CUDA kernels (flash, efficient, cuDNN); on CPU,
``F.scaled_dot_product_attention`` calls ``_scaled_dot_product_flash_attention_for_cpu``
(and its backward), or ``_scaled_dot_product_attention_math`` when DTensor decomposes it.
Attention is independent per batch row and per head, so each op shards on the batch dim
(0) or the head dim (1) of query, key, value, outputs and gradients alike. Grouped-query
attention (fewer key/value heads than query heads) keeps head sharding valid only when the
key/value head count divides by the number of head chunks, since contiguous chunks then pair
each query group with its key/value head. That number is the product of the sizes of the
mesh dims that shard the heads, known only once ``register_sharding`` has expanded one mesh
dim's choices to the whole mesh: the expanded strategies are filtered afterwards. (Bounding
it by the whole mesh instead refused head sharding over ``tp`` on a ``pp x dp x tp`` mesh and
fell back to all-gathered heads, whose local layout then disagreed with the DTensor's.)
An attention mask broadcast over a dim (size 1 there) stays Replicate.

Example::

    import vescale.dtensor.ops  # registers these strategies
    out = F.scaled_dot_product_attention(q_heads_sharded, k_heads_sharded, v_heads_sharded, is_causal=True)
    assert out.placements == (Shard(1),)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from vescale.dtensor import _compat

__all__ = [
    "expand_unpaired_key_value_heads",
    "pairing_query_groups",
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


def _attention_strategies(
    num_outputs: int, num_attention_tensors: int, mask: Any | None
) -> list[tuple[list[Placement], list[Placement]]]:
    """All Replicate, and one strategy per independent dim sharding every tensor on it."""
    mask_count = 0 if mask is None else 1
    strategies: list[tuple[list[Placement], list[Placement]]] = [
        ([Replicate()] * num_outputs, [Replicate()] * (num_attention_tensors + mask_count))
    ]
    for dim in _INDEPENDENT_DIMS:
        inputs: list[Placement] = [Shard(dim)] * num_attention_tensors
        if mask is not None:
            inputs.append(_shard_unless_broadcast(mask, dim))
        strategies.append(([Shard(dim)] * num_outputs, inputs))
    return strategies


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
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
    return _attention_strategies(2, 3, attn_mask)


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
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
    return _attention_strategies(3, 6, attn_mask)


@register_sharding(aten._scaled_dot_product_attention_math.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
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
    return _attention_strategies(2, 3, attn_mask)


# (op, position of query among its arguments); key follows query.
_QUERY_POSITIONS = (
    (aten._scaled_dot_product_flash_attention_for_cpu.default, 0),
    (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 1),
    (aten._scaled_dot_product_attention_math.default, 0),
)


def _head_chunks(spec: Any) -> int:
    """Into how many chunks the mesh cuts ``spec``'s head dim (1)."""
    chunks = 1
    for mesh_dim, placement in enumerate(spec.placements):
        if isinstance(placement, Shard) and placement.dim == 1:
            chunks *= spec.mesh.size(mesh_dim)
    return chunks


def pairing_query_groups(strategy: Callable[[Any], Any], query_position: int) -> Callable[[Any], Any]:
    """``strategy`` without the full-mesh strategies whose head chunks split a key/value group.

    Example::

        paired = pairing_query_groups(_compat.dtensor_op_strategy(op), query_position=0)
        _compat.set_dtensor_op_strategy(op, paired)
    """

    def filtered(op_schema: Any) -> Any:
        expanded = strategy(op_schema)
        query, key = (op_schema.args_schema[query_position + i].strategies[0].output_spec for i in (0, 1))
        query_heads, key_heads = query.shape[1], key.shape[1]
        if query_heads == key_heads:
            return expanded
        expanded.strategies = [
            op_spec
            for op_spec in expanded.strategies
            if key_heads % _head_chunks(op_spec.input_specs[query_position + 1]) == 0
        ]
        return expanded

    filtered.vescale_unfiltered_strategy = strategy  # type: ignore[attr-defined]
    return filtered


def expand_unpaired_key_value_heads(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``scaled_dot_product_attention``'s arguments with grouped key/value heads repeated, where
    the query's head chunks would split a key/value group.

    ``enable_gqa=True`` means each key/value head serves ``query_heads // key_heads``
    consecutive query heads, i.e. ``repeat_interleave`` of key and value along the head dim
    (PyTorch's definition). With more head chunks than key/value heads (tensor parallelism
    beyond the KV-head count: Llama with 2 KV heads on 4 ranks) no head sharding of the
    grouped tensors pairs each rank's query heads with their key/value head, so the repeat
    is done first: every tensor then has the query's heads, and attention shards on heads
    again (each rank slices the repeated key/value heads its query heads use; the repeat's
    backward sums each group's gradients, as single-device GQA does).

    Example::

        args, kwargs = expand_unpaired_key_value_heads((q, k, v), {"enable_gqa": True})
        out = F.scaled_dot_product_attention(*args, **kwargs)
    """
    if not kwargs.get("enable_gqa") or len(args) < 3:
        return args, kwargs
    query, key, value = args[0], args[1], args[2]
    if not all(isinstance(tensor, DTensor) for tensor in (query, key, value)) or query.ndim < 3:
        return args, kwargs
    head_dim = query.ndim - 3
    query_heads, key_heads = query.shape[head_dim], key.shape[head_dim]
    chunks = 1
    for mesh_dim, placement in enumerate(query.placements):
        if isinstance(placement, Shard) and placement.dim % query.ndim == head_dim:
            chunks *= query.device_mesh.size(mesh_dim)
    if query_heads == key_heads or key_heads % chunks == 0 or query_heads % key_heads:
        return args, kwargs
    repeats = query_heads // key_heads
    key = key.repeat_interleave(repeats, dim=head_dim)
    value = value.repeat_interleave(repeats, dim=head_dim)
    return (query, key, value, *args[3:]), {**kwargs, "enable_gqa": False}


def _install() -> None:
    for op, query_position in _QUERY_POSITIONS:
        registered = _compat.dtensor_op_strategy(op)
        # Idempotent: a re-imported module filters register_sharding's function, not its own wrapper.
        unfiltered = getattr(registered, "vescale_unfiltered_strategy", registered)
        _compat.set_dtensor_op_strategy(op, pairing_query_groups(unfiltered, query_position))


_install()
