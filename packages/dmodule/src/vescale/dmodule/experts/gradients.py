"""Gradient averaging under expert parallelism: which group each gradient is reduced over.

With the batch split over the batch dims B (dp and ep, R = |B| ranks) and each rank's loss
the mean over its own tokens, single-device training of the global batch is the mean of the
R ranks' losses, so every gradient is the ranks' contributions summed, divided by R:

* a non-expert parameter (replicated on every batch dim) gets its contributions on every
  rank: all-reduce over all of B, divide by R (plain data parallel over dp×ep);
* an expert parameter already holds, on its owning rank, the contributions of every ep
  rank's tokens (the all-to-all's backward brought them): all-reduce over the batch dims
  other than ep (the ranks holding the same experts), divide by R, not by |dp|.

:func:`average_gradients` does exactly this with one all-reduce per gradient and dim; it is
the reference that a data-parallel wrapper (``vescale.doptim``) must reproduce with its
buckets (expert parameters are marked, see :func:`~.parallelize.is_expert_parameter`).

Example::

    model(input_ids=ids, labels=ids).loss.backward()
    average_gradients(model, mesh)            # now equal to single-device gradients
    optimizer.step()
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vescale.dmodule.experts.parallelize import EXPERT_PARALLEL_ATTRIBUTE, batch_dims_of

__all__ = ["average_gradients", "gradient_reduction_dims"]


def gradient_reduction_dims(
    param: torch.Tensor, mesh: DeviceMesh, batch_dims: Sequence[str]
) -> tuple[str, ...]:
    """The mesh dims ``param``'s gradient is summed over: every batch dim, less ep for experts.

    Example::

        gradient_reduction_dims(experts.gate_up_proj, mesh, ("dp", "ep"))   # ('dp',)
    """
    ep_dim = getattr(param, EXPERT_PARALLEL_ATTRIBUTE, None)
    return tuple(dim for dim in batch_dims if dim != ep_dim)


@torch.no_grad()
def average_gradients(model: nn.Module, mesh: DeviceMesh, *, batch_dims: Sequence[str] | None = None) -> None:
    """Sum each gradient over its :func:`gradient_reduction_dims` and divide by the batch ranks.

    Example::

        loss.backward(); average_gradients(model, init_mesh(dp=2, ep=2)); optimizer.step()
    """
    names = mesh.mesh_dim_names or ()
    batch_dims = tuple(batch_dims) if batch_dims is not None else batch_dims_of(mesh)
    batch_ranks = math.prod(mesh.size(names.index(dim)) for dim in batch_dims)
    for param in model.parameters():
        if param.grad is None:
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        for dim in gradient_reduction_dims(param, mesh, batch_dims):
            if mesh.size(names.index(dim)) > 1:
                dist.all_reduce(grad, group=mesh.get_group(dim))
        grad.div_(batch_ranks)
