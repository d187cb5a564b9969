"""Sharding strategies of element-wise ops that PyTorch's pointwise list leaves out.

PyTorch registers a strategy for every op tagged ``pointwise``; a few element-wise ops
carry no such tag (``floor_divide``, which MoE routing uses to map sorted slots back to
tokens: ``perm // top_k``). An element-wise op may shard its output on any dim, each input
sharded on the same (right-aligned) dim, or Replicate where it broadcasts (size 1). None of
these ops is linear, so Partial inputs are reduced first.

Example::

    import vescale.dtensor.ops
    token_index = sorted_slots // top_k       # Replicate or sharded, as the input is
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = [
    "elementwise_strategies",
    "floor_divide_scalar_strategy",
    "floor_divide_strategy",
    "log_sigmoid_backward_strategy",
]

aten = torch.ops.aten


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


def elementwise_strategies(*operands: Any) -> list[tuple[list[Placement], list[Placement | None]]]:
    """All Replicate, and per output dim: output and inputs sharded there (broadcast dims stay
    Replicate); non-tensor operands get ``None``.

    Example::

        strategies = elementwise_strategies(input_spec, other_spec)
        assert strategies[0] == ([Replicate()], [Replicate(), Replicate()])
    """
    shapes = [_shape(operand) for operand in operands]
    tensor_shapes = [shape for shape in shapes if shape is not None]
    out_ndim = max((len(shape) for shape in tensor_shapes), default=0)
    # torch leaves broadcast_shapes unannotated.
    out_shape = torch.broadcast_shapes(*tensor_shapes) if tensor_shapes else ()  # type: ignore[no-untyped-call]
    strategies: list[tuple[list[Placement], list[Placement | None]]] = [
        ([Replicate()], [None if shape is None else Replicate() for shape in shapes])
    ]
    for out_dim in range(out_ndim):
        if out_shape[out_dim] == 1:
            continue
        inputs: list[Placement | None] = []
        for shape in shapes:
            if shape is None:
                inputs.append(None)
                continue
            dim = out_dim - (out_ndim - len(shape))
            inputs.append(Shard(dim) if dim >= 0 and shape[dim] == out_shape[out_dim] else Replicate())
        strategies.append(([Shard(out_dim)], inputs))
    return strategies


@register_sharding(aten.floor_divide.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
def floor_divide_strategy(self: Any, other: Any) -> list[tuple[list[Placement], list[Placement | None]]]:
    """``torch.floor_divide(self, other)`` with two tensors (a 0-dim ``other`` broadcasts).

    Example::

        token_index = torch.floor_divide(sorted_slots, torch.tensor(2))
    """
    return elementwise_strategies(self, other)


@register_sharding(aten.floor_divide.Scalar)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
def floor_divide_scalar_strategy(
    self: Any, other: Any
) -> list[tuple[list[Placement], list[Placement | None]]]:
    """``tensor // number``.

    Example::

        token_index = sorted_slots // 2
    """
    return elementwise_strategies(self, other)


@register_sharding(aten.log_sigmoid_backward.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
def log_sigmoid_backward_strategy(
    grad_output: Any, self: Any, buffer: Any
) -> list[tuple[list[Placement], list[Placement | None]]]:
    """The gradient of ``F.logsigmoid`` (Inkling's gates), element-wise in all three tensors.

    Example::

        torch.nn.functional.logsigmoid(sharded_gate).sum().backward()
    """
    return elementwise_strategies(grad_output, self, buffer)
