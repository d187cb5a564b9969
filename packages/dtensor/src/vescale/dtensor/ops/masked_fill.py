"""``masked_fill`` with zero keeps a Partial sum: each rank's piece zeroed where the mask is.

DTensor treats ``masked_fill`` as a non-linear element-wise op and refuses a Partial input,
which for the in-place form is an error ("in-place operations that require placement changes
are not supported"; Gemma-3n's ``masked_fill_`` on a row-parallel projection's output). Filling
with zero is linear: the ranks' pieces, zeroed at the same places, sum to the single-device
result. Any other value, or a sharded operand, takes DTensor's own path (which reduces first).

This is a per-call handler, not a sharding strategy, because DTensor caches strategies by
placements and shapes, not by the fill value: a strategy allowing Partial for 0 was reused for
a later fill with 1.5 (measured: 1.5 off).

Example::

    import vescale.dtensor.ops
    partial_scores.masked_fill_(replicated_mask, 0)   # stays Partial, no communication
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vescale.dtensor._op_handlers import dispatch_previous, register_op_handlers
from vescale.dtensor.placements import from_local_like

__all__ = ["masked_fill_handler"]

aten = torch.ops.aten


def _zero_fill_of_partial(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs or len(args) != 3:
        return False
    tensor, mask, value = args
    if not isinstance(tensor, DTensor) or isinstance(value, torch.Tensor) or value != 0:
        return False
    if not any(placement.is_partial("sum") for placement in tensor.placements):
        return False
    if not all(placement.is_partial("sum") or placement.is_replicate() for placement in tensor.placements):
        return False
    if isinstance(mask, DTensor):
        return mask.device_mesh == tensor.device_mesh and all(p.is_replicate() for p in mask.placements)
    return isinstance(mask, torch.Tensor)


def masked_fill_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """DTensor's dispatch of ``masked_fill(_)`` with a scalar: a zero fill of a Partial tensor
    runs on the local pieces; everything else as DTensor would.

    Example::

        filled = torch.ops.aten.masked_fill.Scalar(partial_dtensor, replicated_mask, 0)
    """
    if not _zero_fill_of_partial(args, kwargs):
        return dispatch_previous(op_call, args, kwargs)
    tensor, mask, value = args
    local_mask = mask.to_local() if isinstance(mask, DTensor) else mask
    if op_call is aten.masked_fill_.Scalar:
        tensor.to_local().masked_fill_(local_mask, value)
        return tensor
    local = tensor.to_local().masked_fill(local_mask, value)
    return from_local_like(local, tensor, stride=local.stride())


register_op_handlers(
    {aten.masked_fill.Scalar: masked_fill_handler, aten.masked_fill_.Scalar: masked_fill_handler}
)
