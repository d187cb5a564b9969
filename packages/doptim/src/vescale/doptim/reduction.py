"""Averaging one gradient bucket over the data-parallel group, asynchronously.

Two results: the whole averaged bucket on every rank (``"all_reduce"``, DDP and ZeRO-1) or
only this rank's chunk of it (``"reduce_scatter"``, ZeRO-2). Two orders:

* default: one ``all_reduce`` / ``reduce_scatter_tensor`` (the backend picks the summation
  order), then a division by the dp size; on backends whose reduce-scatter all-reduces a copy
  of its input (:data:`ALL_REDUCE_SCATTER_BACKENDS`, gloo) the bucket is all-reduced in place
  and the chunk copied out: the same sums, without the full-size copy;
* deterministic: an ``all_to_all`` hands every rank the other ranks' copies of its chunk,
  which it sums in rank order 0, 1, 2, ... and divides by the dp size, so each element is
  ``(((g_0 + g_1) + g_2) + ...) / n`` exactly, as one process accumulating the ranks'
  micro-batch gradients in rank order would compute it; for ``"all_reduce"`` the chunks are
  then all-gathered. It moves the bytes of a ring all-reduce (reduce-scatter + all-gather).

:class:`RankOrderedReduceScatter` is the same deterministic reduce-scatter for FSDP2
(ZeRO-3's ``set_custom_reduce_scatter``).

Example::

    reduction = start_reduction(bucket, group, result="all_reduce", deterministic=True)
    ...                                   # backward goes on while the collective runs
    reduction.wait()                      # bucket.grad_buffer now holds the average
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vescale.doptim.buckets import Bucket
from vescale.doptim.errors import DataParallelConfigError

__all__ = [
    "ALL_REDUCE_SCATTER_BACKENDS",
    "REDUCTION_RESULTS",
    "BucketReduction",
    "RankOrderedReduceScatter",
    "all_gather_flat",
    "rank_ordered_average",
    "reduce_scatter_flat",
    "start_reduction",
]

REDUCTION_RESULTS = ("all_reduce", "reduce_scatter")
# Backends whose reduce-scatter all-reduces a full-size copy of its input and keeps the chunk
# (gloo: a 24 MiB bucket on 4 ranks took 26 MiB more memory at its peak, and longer, than the
# in-place all-reduce, +2 MiB): a reduce-scatter result is all-reduced in place there instead.
ALL_REDUCE_SCATTER_BACKENDS = frozenset({"gloo"})

# torch 2.13 renamed the flat collectives and deprecated the old names (2.11 has only those).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rank_ordered_average(
    received: torch.Tensor, dp_size: int, *, average: bool = True, divisor: int | None = None
) -> torch.Tensor:
    """``(((c_0 + c_1) + c_2) + ...) / divisor`` of the ``dp_size`` equal copies in ``received``, in place
    into ``c_0`` (the sum starts from ``c_0`` exactly, as the single-device reference's does);
    ``divisor`` defaults to ``dp_size``."""
    copies = received.view(dp_size, -1)
    total = copies[0]
    for rank in range(1, dp_size):
        total.add_(copies[rank])
    return total.div_(divisor or dp_size) if average else total


class RankOrderedReduceScatter:
    """FSDP2's reduce-scatter, rank-ordered: an ``all_to_all`` then :func:`rank_ordered_average`.

    Plugged in with ``FSDPModule.set_custom_reduce_scatter`` (duck-typed: FSDP2 calls
    ``allocate`` and the object itself). FSDP2 asks for ``ReduceOp.AVG`` for fp32 and bf16
    gradients (it then divides no more) and ``SUM`` when it divides itself.

    Example::

        for unit in fsdp_units:
            unit.set_custom_reduce_scatter(RankOrderedReduceScatter())
    """

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh communication buffer (FSDP2 frees it when the reduction is done)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"the rank-ordered reduce-scatter averages or sums, FSDP2 asked for {op}")
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        dp_size = dist.get_world_size(group)
        output_tensor.copy_(rank_ordered_average(received, dp_size, average=op == dist.ReduceOp.AVG))


@dataclass
class BucketReduction:
    """A bucket's reduction in flight; :meth:`wait` completes it and leaves the average in place."""

    bucket: Bucket
    group: Any
    result: str
    deterministic: bool
    work: Any | None
    received: torch.Tensor | None
    grad_chunk: torch.Tensor | None
    done: bool = False
    # A reduce-scatter run as an in-place all-reduce: the chunk is copied out of the bucket.
    chunk_from_buffer: bool = False

    def is_completed(self) -> bool:
        """Whether the collective has finished (without blocking); :meth:`wait` may still be due."""
        return self.done or bool(self._work().is_completed())

    def _work(self) -> Any:
        if self.work is None:  # set by start_reduction until wait() completes the reduction
            raise DataParallelConfigError(
                f"the reduction of bucket {self.bucket.index} has no collective in flight; wait() it once"
            )
        return self.work

    def _chunk(self) -> torch.Tensor:
        if self.grad_chunk is None:  # start_reduction takes one for result="reduce_scatter"
            raise DataParallelConfigError(
                f"the reduce-scatter of bucket {self.bucket.index} was started without a grad_chunk"
            )
        return self.grad_chunk

    def wait(self) -> None:
        """Block until the collective is done, then finish the average (rank-ordered if deterministic).

        A second call does nothing.
        """
        if self.done:
            return
        self.done = True
        self._work().wait()
        # The work object holds the collective's input and output tensors: a ZeRO-2 bucket's full
        # buffer would outlive its release until backward ends (every bucket's at once, the peak).
        self.work = None
        dp_size = self.bucket.dp_size
        if not self.deterministic:
            averaged = self.bucket.reduced_buffer() if self.result == "all_reduce" else self._chunk()
            if self.chunk_from_buffer:
                start, end = self.bucket.chunk_range(dist.get_rank(self.group))
                averaged.copy_(self.bucket.reduced_buffer()[start:end])
            averaged.div_(self.bucket.divisor)
            return
        if self.received is None:  # start_reduction receives every rank's bucket when deterministic
            raise DataParallelConfigError(
                f"the deterministic reduction of bucket {self.bucket.index} received nothing"
            )
        total = rank_ordered_average(self.received, dp_size, divisor=self.bucket.divisor)
        self.received = None
        if self.result == "reduce_scatter":
            self._chunk().copy_(total)
        else:
            all_gather_flat(self.bucket.reduced_buffer(), total, group=self.group)


def start_reduction(
    bucket: Bucket, group: Any, *, result: str, deterministic: bool, grad_chunk: torch.Tensor | None = None
) -> BucketReduction:
    """Launch the averaging of ``bucket.grad_buffer`` over ``group`` without waiting for it.

    ``grad_chunk`` (``result="reduce_scatter"``) receives this rank's chunk of the average.

    Example::

        start_reduction(bucket, mesh["dp"].get_group(), result="reduce_scatter",
                        deterministic=False, grad_chunk=chunk).wait()
    """
    received = None
    buffer = bucket.reduced_buffer()
    if result == "reduce_scatter" and grad_chunk is None:
        raise DataParallelConfigError(
            f'start_reduction(result="reduce_scatter") of bucket {bucket.index} needs the grad_chunk to fill'
        )
    if group is None or dist.get_world_size(group) == 1:
        # One rank: the sum is the bucket itself; no collective. Divided only when the batch is split
        # over other ranks (an expert bucket of an ep-only mesh), so ranks that are alone stay bitwise.
        if grad_chunk is not None and result == "reduce_scatter":
            grad_chunk.copy_(buffer)
        if bucket.divisor != 1:
            (grad_chunk if grad_chunk is not None and result == "reduce_scatter" else buffer).div_(
                bucket.divisor
            )
        return BucketReduction(bucket, group, result, deterministic, None, None, grad_chunk, done=True)
    chunk_from_buffer = False
    if deterministic:
        received = torch.empty_like(buffer)
        work = dist.all_to_all_single(received, buffer, group=group, async_op=True)
    elif result == "all_reduce":
        work = dist.all_reduce(buffer, group=group, async_op=True)
    elif dist.get_backend(group) in ALL_REDUCE_SCATTER_BACKENDS:
        work = dist.all_reduce(buffer, group=group, async_op=True)
        chunk_from_buffer = True
    else:
        work = reduce_scatter_flat(grad_chunk, buffer, group=group, async_op=True)
    return BucketReduction(
        bucket, group, result, deterministic, work, received, grad_chunk, chunk_from_buffer=chunk_from_buffer
    )
