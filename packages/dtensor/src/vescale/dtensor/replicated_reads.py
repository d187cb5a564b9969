"""Data-dependent reads of DTensors inside a parallelized module's forward.

Model code reads values into Python or into data-dependent shapes: MoE routers call
``expert_counts.tolist()`` (JetMoE) or ``mask.nonzero()`` (LongCat-Flash) to find the experts a
batch uses. DTensor refuses both (``.tolist()`` on a subclass; ``nonzero`` has no sharding
strategy, its output shape depends on the values). Every rank holds the same values of a
Replicate DTensor, so the read runs on the local tensor and gives every rank the single-device
answer; a sharded or Partial DTensor is made whole first (a collective every rank runs, since
every rank runs the same forward). ``nonzero`` returns a Replicate DTensor of the indices.

Example::

    handled, value = read_replicated_values(torch.Tensor.tolist, (counts,), {})
    assert handled and value == counts.full_tensor().tolist()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["read_replicated_values"]


def _whole_local(tensor: DTensor) -> torch.Tensor:
    if all(placement.is_replicate() for placement in tensor.placements):
        return tensor.to_local()
    return tensor.full_tensor()


def _nonzero(tensor: DTensor, *args: Any, **kwargs: Any) -> Any:
    found = torch.nonzero(_whole_local(tensor), *args, **kwargs)
    mesh = tensor.device_mesh
    replicate = [Replicate()] * mesh.ndim
    if isinstance(found, tuple):
        return tuple(DTensor.from_local(index, mesh, replicate, run_check=False) for index in found)
    return DTensor.from_local(found, mesh, replicate, run_check=False)


_READS: dict[Callable[..., Any], Callable[..., Any]] = {
    torch.Tensor.tolist: lambda tensor: _whole_local(tensor).tolist(),
    torch.Tensor.nonzero: _nonzero,
    torch.nonzero: _nonzero,
}


def read_replicated_values(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    """``(True, result)`` when ``func`` is a data-dependent read of a DTensor handled here,
    else ``(False, None)``."""
    read = _READS.get(func)
    if read is None or not args or not isinstance(args[0], DTensor):
        return False, None
    return True, read(*args, **kwargs)
