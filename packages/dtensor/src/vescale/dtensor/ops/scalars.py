"""Reading a Python number out of a DTensor gives the single-device answer on every rank.

``bool(t)``, ``t.item()`` and ``if t:`` reach ``aten.is_nonzero`` / ``aten._local_scalar_dense``.
Stock DTensor reads the rank's *local* value there even when the tensor is Partial: e.g.
``(x > 0).any()`` of a sharded ``x`` is ``Partial(sum)``, so one rank sees True and another
False, and code that branches on it (``nn.init.trunc_normal_``'s resampling loop) takes
different paths on different ranks, which silently desynchronises their random generators.
Here a non-Replicate scalar is reduced to Replicate first; booleans travel as int32 (gloo
has no boolean reductions) and come back as ``!= 0``, which is ``any`` for a sum or max and
``all`` for a min.

Example::

    import vescale.dtensor.ops
    if (sharded_weight.abs() > 2).any():   # the same answer on every rank
        ...
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from vescale.dtensor._op_handlers import dispatch_previous, register_op_handlers
from vescale.dtensor.placements import from_local_like

__all__ = ["SCALAR_READ_OPS", "replicated_value"]

aten = torch.ops.aten

SCALAR_READ_OPS = (aten.is_nonzero.default, aten._local_scalar_dense.default)


def replicated_value(tensor: DTensor) -> torch.Tensor:
    """The full value of ``tensor`` as a plain tensor, the same on every rank.

    Example::

        flag = replicated_value((x > 0).any())   # a reduced bool, identical on every rank
    """
    if all(isinstance(placement, Replicate) for placement in tensor.placements):
        return tensor.to_local()
    local = tensor.to_local()
    is_bool = local.dtype == torch.bool
    carried = from_local_like(local.to(torch.int32) if is_bool else local, tensor)
    full = carried.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim).to_local()
    return full != 0 if is_bool else full


def _scalar_read_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    source = args[0]
    if not isinstance(source, DTensor) or all(isinstance(p, Replicate) for p in source.placements):
        return dispatch_previous(op_call, args, kwargs)
    return op_call(replicated_value(source), *args[1:], **kwargs)


register_op_handlers(dict.fromkeys(SCALAR_READ_OPS, _scalar_read_handler))
