"""``clip_grad_norm_``: the single-device global gradient norm over every shard and mesh dim.

Each rank sums the ``p``-th powers of the gradient elements it *owns*, so that every
element of the single-device gradient is counted exactly once over the whole mesh: a
piece sharded over a mesh dim (tensor parallel ``Shard``, a ZeRO chunk, FSDP2's dp shard) is
owned by every rank of that dim; a piece replicated over a dim is owned only by the rank
at coordinate 0 of it. Over a pipeline's ``pp`` mesh dim every rank owns its own stages'
gradients (the stages hold different parameters); a tied parameter that several stages hold
(:func:`mark_pipeline_copy`) is counted by the ranks of the first stage that holds it. The sums
are then all-reduced over every mesh dim. The gradients are scaled as
``torch.nn.utils.clip_grad_norm_`` scales them.

Example::

    total_norm = clip_grad_norm_(optimizer, max_norm=1.0)   # a DistributedOptimizer
    optimizer.step()
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vescale.doptim.buckets import local_tensor
from vescale.doptim.ddp import data_parallel_of
from vescale.doptim.errors import DataParallelConfigError, DataParallelMeshError

__all__ = ["GradPiece", "clip_grad_norm_", "is_pipeline_copy", "mark_pipeline_copy", "sharded_mesh_dims"]

# The mesh dim of pipeline stages: its ranks hold different parameters, not copies of the same.
_PIPELINE_MESH_DIM = "pp"
# Set on the parameter itself (as FSDP marks its parameters): a weak set of tensors would compare
# them with the elementwise ``==``.
_PIPELINE_COPY_ATTRIBUTE = "_vescale_pipeline_copy"


def mark_pipeline_copy(parameter: torch.Tensor) -> None:
    """Record that ``parameter`` is a tied parameter's copy whose gradient another pipeline stage counts.

    A pipeline calls it on every rank that holds a tied parameter (GPT-2's ``wte``/``lm_head``) but
    not the first stage that holds it: all of them hold the tied gradient sum, and the global norm
    counts it once, on the first stage's ranks. The copy is still scaled when clipping.

    Example::

        if min(tied.stages) not in local_stages:
            mark_pipeline_copy(tied.parameter)
    """
    setattr(parameter, _PIPELINE_COPY_ATTRIBUTE, True)


def is_pipeline_copy(parameter: torch.Tensor) -> bool:
    """Whether :func:`mark_pipeline_copy` marked ``parameter``.

    Example::

        counted_here = not is_pipeline_copy(param)
    """
    return getattr(parameter, _PIPELINE_COPY_ATTRIBUTE, False)


@dataclass
class GradPiece:
    """A gradient tensor this rank holds and the mesh dims over which it differs between ranks."""

    grad: torch.Tensor
    mesh: DeviceMesh | None
    sharded_dims: frozenset[int]
    # A tied parameter's copy on a pipeline stage after the first that holds it (mark_pipeline_copy).
    pipeline_copy: bool = False

    def owned(self) -> bool:
        """Whether this rank counts the piece: it sits at coordinate 0 of every dim it is replicated on.

        Every rank of a pipeline's ``pp`` dim counts its own stages' pieces; a pipeline copy is
        counted by the first stage that holds it, so nowhere here.
        """
        if self.pipeline_copy:
            return False
        if self.mesh is None:
            return True
        names = self.mesh.mesh_dim_names or ()
        return all(
            dim in self.sharded_dims
            or (dim < len(names) and names[dim] == _PIPELINE_MESH_DIM)
            or self.mesh.get_local_rank(dim) == 0
            for dim in range(self.mesh.ndim)
        )


def sharded_mesh_dims(param: torch.Tensor) -> frozenset[int]:
    """The mesh dims a DTensor parameter is sharded over (none for a plain tensor).

    Any placement that is neither Replicate nor Partial splits the tensor: ``Shard``, and also
    FSDP2's ``_StridedShard`` over dp of a tp-sharded parameter and veScale's extra placements,
    whose ``is_shard()`` is false.
    """
    if not isinstance(param, DTensor):
        return frozenset()
    return frozenset(
        dim
        for dim, placement in enumerate(param.placements)
        if not (placement.is_replicate() or placement.is_partial())
    )


def _pieces_of_parameters(parameters: Iterable[torch.Tensor]) -> list[GradPiece]:
    pieces = []
    for param in parameters:
        owner = data_parallel_of(param)
        if owner is not None and owner.zero_stage == 2:
            raise DataParallelConfigError(
                "under ZeRO-2 a parameter keeps no full gradient; pass the DistributedOptimizer: "
                "clip_grad_norm_(optimizer, max_norm)"
            )
        if param.grad is None:
            continue
        mesh = owner.device_mesh if owner is not None else getattr(param, "device_mesh", None)
        pieces.append(
            GradPiece(local_tensor(param.grad), mesh, sharded_mesh_dims(param), is_pipeline_copy(param))
        )
    return pieces


def clip_grad_norm_(
    parameters_or_optimizer: Iterable[torch.Tensor] | torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale the gradients so that their global ``norm_type``-norm is at most ``max_norm``; return the norm.

    Takes a :class:`~vescale.doptim.DistributedOptimizer` (required under ZeRO-2) or parameters.

    Example::

        norm = clip_grad_norm_(optimizer, 1.0)
        norm = clip_grad_norm_(model.parameters(), 1.0)   # ZeRO 0, 1, 3 or no data parallel
    """
    grad_pieces = getattr(parameters_or_optimizer, "grad_pieces", None)
    if callable(grad_pieces):
        pieces = grad_pieces()
    else:
        parameters = parameters_or_optimizer
        if isinstance(parameters, torch.optim.Optimizer):
            raise DataParallelConfigError(
                f"clip_grad_norm_ got a {type(parameters).__name__}, which has no grad_pieces(); pass the "
                "model's parameters, or a DistributedOptimizer"
            )
        pieces = _pieces_of_parameters([parameters] if isinstance(parameters, torch.Tensor) else parameters)
    if not pieces:
        return torch.tensor(0.0)
    meshes = {id(piece.mesh): piece.mesh for piece in pieces if piece.mesh is not None}
    # Meshes over the same ranks (a mesh and one with some of its dims flattened, as FSDP2 makes
    # over dp x ep) count each piece on their own dims and reduce over the same ranks: one norm.
    rank_sets = {tuple(sorted(mesh.mesh.flatten().tolist())) for mesh in meshes.values()}
    if len(rank_sets) > 1:
        raise DataParallelMeshError(
            f"the gradients live on {len(meshes)} meshes over different ranks; clip each model's "
            "parameters separately"
        )
    meshes = dict(list(meshes.items())[:1])
    if meshes:
        # A plain-tensor gradient beside DTensor ones (e.g. a router next to experts sharded over ep)
        # is the same on every rank of the mesh: count it on coordinate 0 of every dim only, or the
        # all-reduces below would add it once per rank.
        mesh = next(iter(meshes.values()))
        pieces = [
            piece
            if piece.mesh is not None
            else GradPiece(piece.grad, mesh, piece.sharded_dims, piece.pipeline_copy)
            for piece in pieces
        ]
    norm_type = float(norm_type)
    owned = [piece.grad for piece in pieces if piece.owned()]
    zero = torch.zeros((), dtype=torch.float32, device=pieces[0].grad.device)
    if math.isinf(norm_type):
        total = torch.stack(
            [zero, *(grad.detach().abs().max().float() for grad in owned if grad.numel())]
        ).max()
    else:
        total = sum((grad.detach().float().pow(norm_type).sum() for grad in owned), zero)
    for mesh in meshes.values():
        for dim in range(mesh.ndim):
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(total, op=op, group=mesh.get_group(dim))
    total_norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for piece in pieces:
        piece.grad.detach().mul_(clip_coef.to(piece.grad.dtype))
    return total_norm
