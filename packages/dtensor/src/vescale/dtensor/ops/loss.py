"""Cross-entropy on vocabulary-sharded logits without gathering them (always on, no context).

A tensor-parallel LM head leaves the logits ``Shard(-1)`` over the vocabulary; the loss
(``F.cross_entropy`` = ``_log_softmax`` + ``nll_loss_forward``, in ``transformers`` and in
nanoGPT alike) would otherwise all-gather a ``tokens x vocab`` tensor. These handlers keep
the class dim sharded, in the manner of PyTorch's ``loss_parallel`` but registered for good:

* ``_log_softmax``: each rank takes its slice's row maxima and sums of exponentials (shifted
  by its own maxima), one all-gather of the two ``tokens x 1`` columns over the mesh dim that
  shards the class dim, then every rank combines them (the global maximum M, and the sum of
  each slice's sum times exp(its maximum - M)); the output stays sharded. One blocking
  collective where a maximum's and a sum's all-reduce would be two;
* ``nll_loss_forward``: each rank picks the log-probability of the targets in its vocabulary
  slice (zero elsewhere), one all-reduce of the ``tokens`` picked values, then the reduction
  (``mean``/``sum``/``none``, ``ignore_index``) is done by aten itself on that column;
* ``nll_loss_backward`` / ``_log_softmax_backward_data``: local, no communication. The
  softmax backward needs each row's gradient sum; the gradient ``nll_loss_backward`` makes
  has one non-zero per row, at the target, whose value every rank knows, so it carries its
  row sums along (as in Megatron's formulation, which reduces nothing in the backward) and
  they replace the ``tokens x 1`` all-reduce, with bitwise the same result. A gradient that
  reaches the softmax any other way (summed with another, changed in place) is reduced.

Other layouts (class dim not sharded, class weights, the class dim sharded on several mesh
dims, interleaved) go to DTensor's own dispatch.

Example::

    import vescale.dtensor.ops  # registers the handlers
    loss = F.cross_entropy(logits_vocab_sharded.view(-1, vocab), labels.view(-1))  # no all-gather
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.dtensor._op_handlers import dispatch_previous, register_op_handlers
from vescale.dtensor.placements import from_local_like

__all__ = ["VOCAB_PARALLEL_LOSS_OPS"]

aten = torch.ops.aten


@dataclass(frozen=True)
class _ClassSharding:
    """The one mesh dim that shards the class dim, and this rank's slice of the classes."""

    mesh_dim: int
    offset: int
    group: Any


def _class_sharding(tensor: Any, class_dim: int) -> _ClassSharding | None:
    """How ``tensor`` shards ``class_dim`` if a single plain Shard does and the rest is Replicate."""
    if not isinstance(tensor, DTensor) or tensor.device_mesh.get_coordinate() is None:
        return None
    class_dim %= tensor.ndim
    sharding_dims = [i for i, p in enumerate(tensor.placements) if type(p) is Shard and p.dim == class_dim]
    others_replicate = all(
        p.is_replicate() for i, p in enumerate(tensor.placements) if i not in sharding_dims
    )
    if len(sharding_dims) != 1 or not others_replicate:
        return None
    mesh_dim = sharding_dims[0]
    mesh = tensor.device_mesh
    num_classes, num_chunks = tensor.shape[class_dim], mesh.size(mesh_dim)
    # torch.chunk semantics, as Shard uses: ceil-sized chunks, trailing ones short or empty.
    chunk = -(-num_classes // num_chunks)
    offset = min(mesh.get_local_rank(mesh_dim) * chunk, num_classes)
    return _ClassSharding(mesh_dim, offset, mesh.get_group(mesh_dim))


def _replicated_local(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    return tensor


def _like(local: torch.Tensor, exemplar: DTensor) -> DTensor:
    """A contiguous DTensor with ``exemplar``'s global shape and placements around ``local``."""
    return from_local_like(local, exemplar, stride=torch.empty(exemplar.shape, device="meta").stride())


def _replicated_scalar(local: torch.Tensor, mesh: Any) -> DTensor:
    return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _log_softmax_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    source, dim, half_to_float = args[0], args[1], args[2]
    sharding = _class_sharding(source, dim)
    if sharding is None:
        return dispatch_previous(op_call, args, kwargs)
    local = source.to_local()
    if half_to_float:
        local = local.float()
    dim %= local.ndim
    row_max, sum_exp = _global_row_statistics(local, dim, sharding.group)
    return _like(local - row_max - sum_exp.log(), source)


def _global_row_statistics(local: torch.Tensor, dim: int, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The maximum over every rank's slice of ``dim`` and the sum of exp(value - maximum), both
    keeping ``dim`` as size 1, from one all-gather of each slice's own two statistics."""
    column = (*local.shape[:dim], 1, *local.shape[dim + 1 :])
    if local.size(dim) == 0:
        own_max = local.new_full(column, -torch.inf)
        own_sum = local.new_zeros(column)
    else:
        own_max = local.amax(dim, keepdim=True)
        # A row whose slice is all -inf (masked classes) shifts by 0: its exponentials are 0.
        own_sum = (local - torch.where(torch.isneginf(own_max), 0.0, own_max)).exp().sum(dim, keepdim=True)
    statistics = torch.stack([own_max, own_sum])
    gathered = [torch.empty_like(statistics) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, statistics, group=group)
    maxima, sums = torch.stack(gathered).unbind(1)  # each ranks x column
    row_max = maxima.amax(0)
    # A slice without classes, or with only -inf in a row (maximum -inf), adds nothing.
    scale = torch.where(torch.isneginf(maxima), 0.0, (maxima - row_max).exp())
    return row_max, (sums * scale).sum(0)


@dataclass(frozen=True)
class _RowSums:
    """The class-dim sums of a gradient made by ``nll_loss_backward``, the same on every rank."""

    values: torch.Tensor
    # The local gradient's version counter when the sums were taken: an in-place change voids them.
    version: int


# An attribute of the gradient DTensor (a dict keyed by tensors would compare them elementwise).
_ROW_SUMS_ATTRIBUTE = "_vescale_nll_row_sums"


def _known_row_sums(grad_output: DTensor, output: DTensor) -> torch.Tensor | None:
    row_sums = getattr(grad_output, _ROW_SUMS_ATTRIBUTE, None)
    if row_sums is None or grad_output.placements != output.placements:
        return None
    return row_sums.values if row_sums.version == grad_output.to_local()._version else None


def _log_softmax_backward_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    grad_output, output, dim, input_dtype = args
    sharding = _class_sharding(output, dim)
    if sharding is None or not isinstance(grad_output, DTensor):
        return dispatch_previous(op_call, args, kwargs)
    local_output = output.to_local()
    dim %= local_output.ndim
    grad_sum = _known_row_sums(grad_output, output)
    local_grad = grad_output.redistribute(output.device_mesh, output.placements).to_local()
    if grad_sum is None:
        grad_sum = local_grad.sum(dim, keepdim=True)
        dist.all_reduce(grad_sum, dist.ReduceOp.SUM, group=sharding.group)
    grad_input = (local_grad - local_output.exp() * grad_sum).to(input_dtype)
    return _like(grad_input, output)


@dataclass(frozen=True)
class _TargetColumn:
    """Where each target falls in this rank's vocabulary slice, and aten's view of the targets
    as one column: class 0 for counted rows, ``ignore_index`` for ignored ones."""

    local_index: torch.Tensor
    in_slice: torch.Tensor
    column_target: torch.Tensor


def _target_column(target: torch.Tensor, local_classes: int, offset: int, ignore_index: int) -> _TargetColumn:
    local_index = target - offset
    in_slice = (local_index >= 0) & (local_index < local_classes) & (target != ignore_index)
    column_target = torch.where(target == ignore_index, ignore_index, 0)
    return _TargetColumn(local_index.clamp(0, max(local_classes - 1, 0)), in_slice, column_target)


def _loss_arguments(log_probs: Any, target: Any, weight: Any) -> _ClassSharding | None:
    if weight is not None or not isinstance(log_probs, DTensor) or log_probs.ndim not in (1, 2):
        return None
    if isinstance(target, DTensor) and not all(p.is_replicate() for p in target.placements):
        return None
    return _class_sharding(log_probs, log_probs.ndim - 1)


def _picked_log_probs(local: torch.Tensor, column: _TargetColumn, group: Any) -> torch.Tensor:
    """``log_probs[n, target[n]]`` for every row n, summed over the ranks' slices."""
    if local.size(-1) == 0:
        picked = local.new_zeros(column.in_slice.shape)
    else:
        picked = local.gather(-1, column.local_index.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(column.in_slice, picked, 0.0)
    dist.all_reduce(picked, dist.ReduceOp.SUM, group=group)
    return picked


def _nll_loss_forward_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    log_probs, target, weight, reduction, ignore_index = args
    sharding = _loss_arguments(log_probs, target, weight)
    if sharding is None:
        return dispatch_previous(op_call, args, kwargs)
    mesh = log_probs.device_mesh
    local = log_probs.to_local()
    column = _target_column(_replicated_local(target, mesh), local.size(-1), sharding.offset, ignore_index)
    picked = _picked_log_probs(local, column, sharding.group)
    output, total_weight = op_call(picked.unsqueeze(-1), column.column_target, None, reduction, ignore_index)
    return _replicated_scalar(output, mesh), _replicated_scalar(total_weight, mesh)


def _nll_loss_backward_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    grad_output, log_probs, target, weight, reduction, ignore_index, total_weight = args
    sharding = _loss_arguments(log_probs, target, weight)
    if sharding is None:
        return dispatch_previous(op_call, args, kwargs)
    mesh = log_probs.device_mesh
    local = log_probs.to_local()
    target_local = _replicated_local(target, mesh)
    column = _target_column(target_local, local.size(-1), sharding.offset, ignore_index)
    column_shape = (*column.in_slice.shape, 1)
    grad_column = op_call(
        _replicated_local(grad_output, mesh),
        local.new_empty(column_shape),
        column.column_target,
        None,
        reduction,
        ignore_index,
        _replicated_local(total_weight, mesh),
    )
    grad_local = torch.zeros_like(local)
    if local.size(-1) > 0:
        grad_local.scatter_(
            -1, column.local_index.unsqueeze(-1), torch.where(column.in_slice.unsqueeze(-1), grad_column, 0.0)
        )
    grad = _like(grad_local, log_probs)
    # Each counted row's one non-zero lies in exactly one rank's slice: its sum over the class
    # dim is that value, and zero for ignored rows (and for targets outside the classes).
    counted = (target_local >= 0) & (target_local < log_probs.shape[-1]) & (target_local != ignore_index)
    row_sums = torch.where(counted.unsqueeze(-1), grad_column, 0.0)
    setattr(grad, _ROW_SUMS_ATTRIBUTE, _RowSums(row_sums, grad_local._version))
    return grad


VOCAB_PARALLEL_LOSS_OPS = {
    aten._log_softmax.default: _log_softmax_handler,
    aten._log_softmax_backward_data.default: _log_softmax_backward_handler,
    aten.nll_loss_forward.default: _nll_loss_forward_handler,
    aten.nll_loss_backward.default: _nll_loss_backward_handler,
}

register_op_handlers(VOCAB_PARALLEL_LOSS_OPS)
