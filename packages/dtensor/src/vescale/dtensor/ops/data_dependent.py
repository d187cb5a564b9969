"""``nonzero`` of a DTensor where aten itself needs it: boolean-mask indexing.

:mod:`vescale.dtensor.replicated_reads` answers ``mask.nonzero()`` written in model code. Indexing
with a boolean mask (X-MOD's ``hidden_states[lang_mask]``, LongCat-Flash's expert selection)
reaches ``aten.index`` with a boolean DTensor, below any ``__torch_function__`` mode, and
DTensor cannot propagate it: the output's shape depends on the mask's values, so its fake run
stops at ``aten.nonzero``. Here a boolean (or uint8) mask index is first turned into the long
indices of its true entries (the mask gathered whole if it is sharded or partial; a Replicate
DTensor that every rank computes alike), which is what aten does with a mask, and the index
runs with those; ``aten.nonzero`` itself gets the same answer.

Example::

    import vescale.dtensor.ops.data_dependent  # registers the handler
    picked = hidden_dtensor[mask_dtensor]       # a Replicate mask: no communication
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from vescale.dtensor._op_handlers import dispatch_previous, register_op_handlers
from vescale.dtensor.replicated_reads import read_replicated_values

__all__ = ["mask_index_handler", "nonzero_handler"]


def nonzero_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """DTensor's dispatch of ``aten.nonzero``: the whole tensor's indices, replicated.

    Example::

        indices = torch.ops.aten.nonzero.default(mask_dtensor)  # Replicate DTensor
    """
    _, indices = read_replicated_values(torch.nonzero, args, kwargs)
    return indices


def _is_mask(index: Any) -> bool:
    return isinstance(index, DTensor) and index.dtype in (torch.bool, torch.uint8)


def mask_index_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """DTensor's dispatch of ``aten.index.Tensor``: boolean mask indices become long indices.

    Example::

        picked = torch.ops.aten.index.Tensor(hidden_dtensor, [mask_dtensor])
    """
    tensor, indices = args[0], args[1]
    if not any(_is_mask(index) for index in indices):
        return dispatch_previous(op_call, args, kwargs)
    expanded: list[Any] = []
    for index in indices:
        if _is_mask(index):
            # The handler returns the indices tensor (a Replicate DTensor); handlers are typed object.
            positions = cast(torch.Tensor, nonzero_handler(torch.ops.aten.nonzero.default, (index,), {}))
            expanded.extend(positions.unbind(1))
        else:
            expanded.append(index)
    return op_call(tensor, expanded, *args[2:], **kwargs)


register_op_handlers(
    {torch.ops.aten.nonzero.default: nonzero_handler, torch.ops.aten.index.Tensor: mask_index_handler}
)
