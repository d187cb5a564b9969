"""The tensors an optimizer steps under ZeRO stages 0-2: each rank's range of each parameter.

Stage 0 gives every rank all of each parameter; stages 1 and 2 give rank ``r`` the part of
each parameter inside its chunk of the parameter's bucket (a ragged range, possibly
empty). The stepped tensor (the *master*) is a view of the parameter's own storage when
the master dtype is the parameter's, so a step updates the parameter in place, or a
separate copy (fp32 master weights for bf16 parameters). After the step, stages 1 and 2
hand every rank the updated chunks: one all-gather per bucket, or, where the backend's
broadcast is faster than its all-gather (gloo, whose flat all-gather measured 34-53 ms against
22-26 ms for one broadcast per rank, 24 MiB over 4 ranks on 2 cores), a broadcast of each
chunk owner's range of each parameter straight into the parameters (no gathered buffer, as
``torch.distributed.optim.ZeroRedundancyOptimizer`` does).

Example::

    shards = build_param_shards(ddp, master_dtype=torch.float32)
    load_grads(ddp, shards); optimizer.step(); publish_params(ddp, shards)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vescale.doptim.buckets import Bucket, ParamSlot, local_tensor
from vescale.doptim.ddp import DDP
from vescale.doptim.errors import DataParallelConfigError
from vescale.doptim.reduction import all_gather_flat

__all__ = [
    "BROADCAST_BACKENDS",
    "MAX_GATHERS_IN_FLIGHT",
    "ParamShard",
    "build_param_shards",
    "load_grads",
    "publish_params",
]


@dataclass
class ParamShard:
    """This rank's flat range ``[start, end)`` of a parameter's local tensor and the tensor stepped for it."""

    fqn: str
    param: nn.Parameter
    bucket: Bucket | None
    slot: ParamSlot | None
    start: int
    end: int
    master: torch.Tensor

    def bucket_and_slot(self) -> tuple[Bucket, ParamSlot]:
        """The DDP bucket and slot of the parameter (ZeRO 0-2; ZeRO-3's shards have neither)."""
        if self.bucket is None or self.slot is None:
            raise DataParallelConfigError(
                f"parameter {self.fqn!r} has no DDP gradient bucket: its optimizer state is ZeRO-3's "
                "(fully_shard), which keeps no buckets"
            )
        return self.bucket, self.slot

    @property
    def master_is_view(self) -> bool:
        """Whether stepping the master updates the parameter's storage directly."""
        return self.master.dtype == self.param.dtype


def _rank_range(ddp: DDP, bucket: Bucket, slot: ParamSlot) -> tuple[int, int]:
    if ddp.zero_stage == 0:
        return 0, slot.numel
    return slot.range_in_chunk(*bucket.chunk_range(bucket.reduction_group.rank))


def build_param_shards(ddp: DDP, *, master_dtype: torch.dtype | None) -> dict[int, ParamShard]:
    """``{id(param): ParamShard}`` for every parameter of ``ddp``; ``master_dtype=None`` keeps each
    parameter's dtype (the masters are then views).

    Example::

        shards = build_param_shards(ddp, master_dtype=None)
    """
    shards = {}
    for bucket, slot in ddp.slots():
        start, end = _rank_range(ddp, bucket, slot)
        flat = local_tensor(slot.param).detach().view(-1)[start:end]
        # Masters are never narrower than their parameter (a float64 model steps in float64).
        dtype = torch.promote_types(master_dtype, slot.param.dtype) if master_dtype else slot.param.dtype
        master = flat if dtype == flat.dtype else flat.to(dtype=dtype, copy=True)
        shards[id(slot.param)] = ParamShard(slot.fqn, slot.param, bucket, slot, start, end, master)
    return shards


def load_grads(ddp: DDP, shards: dict[int, ParamShard]) -> None:
    """Point (or copy, across dtypes) each master's ``.grad`` at its averaged range of the bucket,
    or at the parameter's own gradient where ``ddp`` keeps it (one rank)."""
    for shard in shards.values():
        if id(shard.param) in ddp.unused_params:
            shard.master.grad = None  # no rank used it: the optimizer skips it, as on one device
            continue
        if ddp.keeps_own_gradient(shard.param):
            # One rank: the gradient autograd made is the gradient (None: the optimizer skips it).
            own = shard.param.grad
            if own is None:
                shard.master.grad = None
                continue
            own = own.reshape(-1)[shard.start : shard.end]
            shard.master.grad = own if own.dtype == shard.master.dtype else own.to(shard.master.dtype)
            continue
        bucket, slot = shard.bucket_and_slot()
        if ddp.zero_stage == 2:
            chunk_start = bucket.chunk_range(bucket.reduction_group.rank)[0]
            source = bucket.reduced_chunk()[
                slot.offset + shard.start - chunk_start : slot.offset + shard.end - chunk_start
            ]
        elif bucket.grad_buffer is None:
            # A lazy bucket over one rank that no gradient reached: the optimizer skips it.
            shard.master.grad = None
            continue
        else:
            source = bucket.reduced_buffer()[slot.offset + shard.start : slot.offset + shard.end]
        shard.master.grad = source if source.dtype == shard.master.dtype else source.to(shard.master.dtype)


# Backends whose broadcasts (one per chunk owner) beat their flat all-gather: stages 1-2 publish
# the stepped ranges by broadcast there.
BROADCAST_BACKENDS = frozenset({"gloo"})

# Parameter all-gathers in flight at once: each holds a full-size bucket, so two keep one
# collective running while the previous bucket is copied out, and the temporary memory of
# publishing is two buckets whatever the model size.
MAX_GATHERS_IN_FLIGHT = 2


def _start_gather(ddp: DDP, bucket: Bucket, shards: dict[int, ParamShard]) -> tuple[torch.Tensor, Any]:
    dtype = bucket.slots[0].param.dtype
    chunk_start = bucket.chunk_range(bucket.reduction_group.rank)[0]
    chunk = torch.zeros(bucket.chunk_numel, dtype=dtype, device=bucket.device)
    for slot in bucket.slots:
        shard = shards[id(slot.param)]
        begin = slot.offset + shard.start - chunk_start
        chunk[begin : begin + shard.end - shard.start].copy_(shard.master)
    gathered = torch.empty(bucket.padded_numel, dtype=dtype, device=chunk.device)
    return gathered, all_gather_flat(gathered, chunk, group=bucket.reduction_group.group, async_op=True)


def _finish_gather(bucket: Bucket, gathered: torch.Tensor, work: Any) -> None:
    work.wait()
    for slot in bucket.slots:
        local_tensor(slot.param).view(-1).copy_(gathered[slot.offset : slot.offset + slot.numel])


def _publish_by_broadcast(ddp: DDP, shards: dict[int, ParamShard]) -> None:
    """Every chunk owner broadcasts its range of each parameter in place; all in flight, then waited."""
    works = []
    for bucket in ddp.buckets:
        reduction = bucket.reduction_group
        for slot in bucket.slots:
            flat = local_tensor(slot.param).detach().view(-1)
            shard = shards[id(slot.param)]
            for owner in range(reduction.size):
                start, end = slot.range_in_chunk(*bucket.chunk_range(owner))
                if start == end:
                    continue
                piece = flat[start:end]
                if owner == reduction.rank and not shard.master_is_view:
                    piece.copy_(shard.master)
                if reduction.size > 1:
                    works.append(dist.broadcast(piece, group=reduction.group, group_src=owner, async_op=True))
    for work in works:
        work.wait()


@torch.no_grad()
def publish_params(ddp: DDP, shards: dict[int, ParamShard]) -> None:
    """Write the stepped masters into the parameters: copies where needed; under stages 1-2 the chunks
    reach every rank by broadcasts on :data:`BROADCAST_BACKENDS`, else by all-gathers (bucket by
    bucket, at most ``MAX_GATHERS_IN_FLIGHT`` full buckets allocated at once)."""
    if ddp.zero_stage == 0:
        for shard in shards.values():
            if not shard.master_is_view:
                local_tensor(shard.param).view(-1).copy_(shard.master)
        return
    if ddp.buckets and dist.get_backend(ddp.buckets[0].reduction_group.group) in BROADCAST_BACKENDS:
        _publish_by_broadcast(ddp, shards)
        return
    pending: deque[tuple[Bucket, torch.Tensor, Any]] = deque()
    for bucket in ddp.buckets:
        pending.append((bucket, *_start_gather(ddp, bucket, shards)))
        if len(pending) >= MAX_GATHERS_IN_FLIGHT:
            _finish_gather(*pending.popleft())
    while pending:
        _finish_gather(*pending.popleft())
