"""Experts split over tensor parallelism inside each expert-parallel rank (``expert_tensor_parallel``).

With ``expert_tensor_parallel`` on and ``ep > 1`` (Megatron-Core's expert tensor parallelism),
each expert weight is ``Shard(0)`` over ``ep`` (E/ep whole experts per rank) and split over
``tp`` inside each expert as the tensor-parallel plan says: the up projection (``gate_up_proj``,
gate and up halves interleaved) column-wise, ``down_proj`` row-wise. The tokens are the same on
every tp rank of an ep rank (replicated over tp), so every tp rank dispatches the same rows over
its own ep group; its experts compute a partial sum of each output row (its slice of the
intermediate dim), summed over tp right after the local experts, before the combine:

* :class:`TensorParallelExperts` wraps :class:`~vescale.dmodule.experts.local_experts.LocalExperts`:
  the rows enter through an identity whose backward sums the rows' gradients over tp (each tp
  rank's slice contributes to them), and the outputs leave through a sum over tp whose backward
  is the identity (Megatron's ``f`` and ``g``).

Expert biases are not supported here (a row-parallel bias would be added once per tp rank).

Example::

    compute = TensorParallelExperts(LocalExperts(experts), mesh.get_group("tp"))
    out = compute(rows, counts)   # the full output rows, on every tp rank
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vescale.dmodule.experts.errors import ExpertParallelError
from vescale.dtensor.comm import comm_scope

__all__ = ["TensorParallelExperts", "expert_split_dims"]


class _SumGradientsOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: Any, scope: str) -> torch.Tensor:
        ctx.group, ctx.scope = group, scope
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        with comm_scope(ctx.scope):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _SumOverGroup(torch.autograd.Function):
    """Forward sums the partial rows over ``group``; backward is the identity (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any, scope: str) -> torch.Tensor:
        total = partial.contiguous().clone()
        with comm_scope(scope):
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class TensorParallelExperts:
    """``(rows, counts) -> outputs`` of experts split over ``group`` (tp) inside each expert.

    Example::

        compute = TensorParallelExperts(LocalExperts(experts), mesh.get_group("tp"), scope="layers.1.mlp")
    """

    def __init__(
        self, local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], group: Any, scope: str = ""
    ) -> None:
        self.local_experts = local_experts
        self.group = group
        self.scope = scope

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # torch leaves Function.apply unannotated.
        rows = _SumGradientsOverGroup.apply(rows, self.group, f"{self.scope}/tp_grad")  # type: ignore[no-untyped-call]
        partial = self.local_experts(rows, counts)
        total: torch.Tensor = _SumOverGroup.apply(partial, self.group, f"{self.scope}/tp_sum")  # type: ignore[no-untyped-call]
        return total


def expert_split_dims(
    fqn: str, params: Mapping[str, torch.Tensor], mesh: DeviceMesh, ep_dim: str, has_bias: bool
) -> tuple[str, ...]:
    """The mesh dims (other than ``ep_dim``) over which the experts' DTensor weights are split inside
    each expert; raise for splits expert parallelism cannot keep (the expert dim, partial values,
    another mesh, biases).

    Example::

        expert_split_dims("model.layers.0.mlp.experts", experts._parameters, mesh, "ep", False)  # ("tp",)
    """
    names = mesh.mesh_dim_names or ()
    split: set[str] = set()
    for name, param in params.items():
        if not isinstance(param, DTensor):
            continue
        if param.device_mesh != mesh:
            raise ExpertParallelError(
                f"{fqn}.{name} is a DTensor on {param.device_mesh}, not on the expert-parallel mesh {mesh}; "
                "apply the tensor-parallel plan (parallelize_module) on the same mesh first"
            )
        for index, placement in enumerate(param.placements):
            if placement.is_replicate():
                continue
            # Shard, or the _StridedShard an InterleavedShard becomes (is_shard() is False for it).
            dim = getattr(placement, "dim", None)
            if names[index] == ep_dim or not isinstance(dim, int) or dim % param.dim() == 0:
                raise ExpertParallelError(
                    f"{fqn}.{name} is {placement} on mesh dim {names[index]!r}; expert parallelism shards "
                    f"the expert dim (0) over {ep_dim!r} itself and keeps only splits inside each expert "
                    "(dims 1 and 2): leave the experts Replicate in the tensor-parallel plan, or shard them "
                    "inside each expert"
                )
            split.add(names[index])
    if len(split) > 1:
        raise ExpertParallelError(
            f"{fqn}: the experts are split over several mesh dims {sorted(split)} inside each expert; "
            "expert tensor parallelism sums their partial outputs over one: split them over tp only"
        )
    if split and has_bias:
        raise ExpertParallelError(
            f"{fqn}: experts with biases split over {sorted(split)} inside each expert are not supported "
            "with expert parallelism (a row-parallel bias would be added once per rank); set "
            "expert_tensor_parallel to false (tensor parallelism outside the experts)"
        )
    return tuple(sorted(split))
