"""Sharding strategies of ``Tensor.unfold`` (sliding windows along one dim) and its backward.

DTensor registers none (Inkling-2's windowed attention failed at every TP mode:
"Operator aten.unfold.default does not have a sharding strategy registered"). Windows along
one dim leave every other dim as it is, so a DTensor sharded on another dim unfolds shard by
shard into the same dim of the output (the window dim is appended last); Partial passes
through, as unfold only copies entries. The windowed dim itself is gathered first.

Example::

    import vescale.dtensor.ops
    windows = head_sharded.unfold(2, 4, 1)   # (batch, heads/tp, windows, dim, 4)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from vescale.dtensor._op_handlers import dispatch_previous, register_op_handlers

__all__ = ["unfold_backward_handler", "unfold_backward_strategies", "unfold_strategies"]

aten = torch.ops.aten


def _strategies(ndim: int, windowed: int) -> list[tuple[list[Placement], list[Placement | None]]]:
    strategies: list[tuple[list[Placement], list[Placement | None]]] = [
        ([Replicate()], [Replicate(), None, None, None]),
        ([Partial()], [Partial(), None, None, None]),
    ]
    for dim in range(ndim):
        if dim != windowed:
            strategies.append(([Shard(dim)], [Shard(dim), None, None, None]))
    return strategies


@register_sharding(aten.unfold.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
def unfold_strategies(
    self: Any, dimension: int, size: int, step: int
) -> list[tuple[list[Placement], list[Placement | None]]]:
    """``self.unfold(dimension, size, step)``: sharded on any other dim, Partial, or Replicate.

    Example::

        assert ([Shard(1)], [Shard(1), None, None, None]) in unfold_strategies(meta, 2, 4, 1)
    """
    ndim = len(self.shape)
    return _strategies(ndim, dimension % ndim if ndim else 0)


@register_sharding(aten.unfold_backward.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
def unfold_backward_strategies(
    grad_in: Any, input_sizes: Any, dim: int, size: int, step: int
) -> list[tuple[list[Placement], list[Placement | None]]]:
    """The gradient of ``unfold`` where its sizes are global: Replicate or Partial (a sharded
    gradient takes :func:`unfold_backward_handler`, which passes the local sizes).

    Example::

        assert ([Partial()], [Partial(), None, None, None, None]) in unfold_backward_strategies(g, s, 2, 4, 1)
    """
    return [
        ([Replicate()], [Replicate(), None, None, None, None]),
        ([Partial()], [Partial(), None, None, None, None]),
    ]


def unfold_backward_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """``unfold_backward`` of a gradient sharded on dims other than the windowed one, shard by shard.

    The op takes the input's sizes, which DTensor would pass global to every shard; here each
    shard gets its own (a sharded dim keeps its index and local size through ``unfold``).

    Example::

        grad_input = torch.ops.aten.unfold_backward(grad_windows_sharded_on_heads, sizes, 2, 4, 1)
    """
    grad_in, input_sizes, dim, size, step = args
    ndim = len(input_sizes)
    placements = getattr(grad_in, "placements", ())
    shard_dims = [p.dim % (ndim + 1) for p in placements if isinstance(p, Shard)]
    if (
        kwargs
        or not isinstance(grad_in, DTensor)
        or not shard_dims
        or any(d >= ndim or d == dim % ndim for d in shard_dims)
        or not all(isinstance(p, Shard) or p.is_replicate() for p in placements)
    ):
        return dispatch_previous(op_call, args, kwargs)
    local_grad = grad_in.to_local()
    local_sizes = [local_grad.shape[d] if d in shard_dims else input_sizes[d] for d in range(ndim)]
    local = op_call(local_grad, local_sizes, dim, size, step)
    return DTensor.from_local(
        local,
        grad_in.device_mesh,
        [Shard(p.dim % (ndim + 1)) if isinstance(p, Shard) else p for p in placements],
        run_check=False,
        shape=torch.Size(input_sizes),
        stride=torch.empty(input_sizes, device="meta").stride(),
    )


register_op_handlers({aten.unfold_backward.default: unfold_backward_handler})
