"""Contiguous gradient buckets: the parameters of a data-parallel model packed into flat buffers.

Each parameter's local tensor (a DTensor parameter's local shard) occupies one range of its
bucket's flat buffer; a bucket is reduced over the data-parallel group in one collective as
soon as all of its parameters have their gradients. Buckets are filled in reverse
registration order because backward produces the last layers' gradients first. A bucket's
length is padded to a multiple of the data-parallel size so that rank ``r`` owns the equal
chunk ``[r * chunk, (r + 1) * chunk)`` (ZeRO stages 1 and 2); a parameter may straddle
chunks, so each rank holds ragged ranges of some parameters.

Under ZeRO-2 a bucket's full buffer exists only while it is being filled and reduced
(``lazy=True``): allocated when its first gradient arrives, released once its
reduce-scatter has left this rank's chunk in ``grad_chunk``, so a rank holds full-size
gradients of at most the buckets in flight and 1/dp of the rest.

Example::

    buckets = build_buckets(named_parameters, bucket_size_bytes=2**20, dp_size=2, grad_dtype=torch.float32)
    slot = buckets[0].slots[0]
    grad_view = buckets[0].grad_view(slot)    # shaped like the parameter's local tensor (allocates if lazy)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vescale.doptim.errors import DataParallelConfigError

__all__ = ["Bucket", "ParamSlot", "ReductionGroup", "build_buckets", "local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class ReductionGroup:
    """The ranks a bucket's gradients are summed over, and what the sum is divided by.

    Plain data parallel: every data-parallel rank, divided by their number. Under expert
    parallelism (data parallel over dp x ep) an expert parameter sharded over ``ep`` holds every
    ep rank's contribution already: it sums over ``dp`` only, divided by dp x ep all the same.

    Example::

        ReductionGroup(dims=("dp",), group=mesh.get_group("dp"), size=2, rank=0, divisor=4)
    """

    dims: tuple[str, ...]
    group: Any
    size: int
    rank: int
    divisor: int


@dataclass
class ParamSlot:
    """Where one parameter's local tensor lives in its bucket: ``[offset, offset + numel)``."""

    fqn: str
    param: nn.Parameter
    offset: int
    numel: int
    local_shape: torch.Size

    def range_in_chunk(self, chunk_start: int, chunk_end: int) -> tuple[int, int]:
        """The part ``[start, end)`` of this parameter (in its own flat indices) inside a bucket chunk."""
        start = min(max(chunk_start - self.offset, 0), self.numel)
        end = min(max(chunk_end - self.offset, 0), self.numel)
        return start, max(start, end)


@dataclass
class Bucket:
    """One flat gradient buffer over a few parameters, reduced over dp in one collective."""

    index: int
    slots: list[ParamSlot]
    padded_numel: int
    dp_size: int
    grad_dtype: torch.dtype
    device: torch.device
    # None while a lazy (ZeRO-2) bucket holds no gradient.
    grad_buffer: torch.Tensor | None = None
    # ZeRO-2: this rank's chunk of the averaged bucket (the full buffer is not reduced).
    grad_chunk: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    # The group the bucket is reduced over (None: the DDP's whole dp group, divided by dp_size).
    reduction: ReductionGroup | None = None

    @property
    def divisor(self) -> int:
        """What the summed gradients are divided by: the ranks the batch is split over."""
        return self.reduction.divisor if self.reduction is not None else self.dp_size

    @property
    def reduction_group(self) -> ReductionGroup:
        """The group the bucket is reduced over (DDP sets it when it builds its buckets)."""
        if self.reduction is None:
            raise DataParallelConfigError(
                f"bucket {self.index} has no reduction group; build buckets through DDP (build_buckets "
                "with reduction_of)"
            )
        return self.reduction

    def reduced_buffer(self) -> torch.Tensor:
        """The full gradient buffer, which must exist (a bucket whose gradients arrived)."""
        if self.grad_buffer is None:
            raise DataParallelConfigError(
                f"bucket {self.index} holds no gradient buffer; read it after backward, before it is released"
            )
        return self.grad_buffer

    def reduced_chunk(self) -> torch.Tensor:
        """This rank's chunk of the averaged bucket (ZeRO-2), which must exist."""
        if self.grad_chunk is None:
            raise DataParallelConfigError(
                f"bucket {self.index} holds no reduced chunk; read it after the ZeRO-2 reduction ran"
            )
        return self.grad_chunk

    @property
    def chunk_numel(self) -> int:
        """Elements of the bucket each dp rank owns under ZeRO stages 1 and 2."""
        return self.padded_numel // self.dp_size

    def chunk_range(self, dp_rank: int) -> tuple[int, int]:
        """``[start, end)`` of dp rank ``dp_rank``'s chunk of the bucket."""
        return dp_rank * self.chunk_numel, (dp_rank + 1) * self.chunk_numel

    def allocate_grad_buffer(self) -> torch.Tensor:
        """The full gradient buffer, zero-filled when it does not exist yet."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.device)
        return self.grad_buffer

    def allocate_grad_chunk(self) -> torch.Tensor:
        """This rank's chunk of the reduced gradient (ZeRO-2), allocated on first use."""
        if self.grad_chunk is None:
            self.grad_chunk = torch.empty(self.chunk_numel, dtype=self.grad_dtype, device=self.device)
        return self.grad_chunk

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The parameter's gradient inside the bucket, shaped like its local tensor."""
        flat = self.allocate_grad_buffer()
        return flat[slot.offset : slot.offset + slot.numel].view(slot.local_shape)


def build_buckets(
    named_parameters: Sequence[tuple[str, nn.Parameter]],
    *,
    bucket_size_bytes: int,
    dp_size: int,
    grad_dtype: torch.dtype,
    lazy: bool = False,
    reduction_of: Callable[[nn.Parameter], ReductionGroup] | None = None,
) -> list[Bucket]:
    """Pack the parameters, last first, into buckets of at most ``bucket_size_bytes`` and one parameter
    dtype each (one parameter larger than that gets a bucket of its own). ``lazy=True`` allocates no
    gradient buffer until a gradient arrives (ZeRO-2). ``reduction_of`` gives each parameter its
    :class:`ReductionGroup` (a bucket holds one; its chunks are that group's); without it every
    bucket is reduced over the ``dp_size`` ranks.

    Example::

        buckets = build_buckets(list(model.named_parameters()), bucket_size_bytes=2**20, dp_size=4,
                                grad_dtype=torch.float32)
    """
    element_size = torch.empty((), dtype=grad_dtype).element_size()
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    group_bytes = 0
    for fqn, param in reversed(named_parameters):
        param_bytes = local_tensor(param).numel() * element_size
        # One parameter dtype per bucket: ZeRO all-gathers a bucket's parameters as one flat tensor.
        dtype_changes = bool(groups[-1]) and groups[-1][-1][1].dtype != param.dtype
        group_changes = (
            bool(groups[-1])
            and reduction_of is not None
            and reduction_of(groups[-1][-1][1]) != reduction_of(param)
        )
        if groups[-1] and (dtype_changes or group_changes or group_bytes + param_bytes > bucket_size_bytes):
            groups.append([])
            group_bytes = 0
        groups[-1].append((fqn, param))
        group_bytes += param_bytes
    buckets = []
    for index, group in enumerate(group for group in groups if group):
        slots, offset = [], 0
        for fqn, param in group:
            local = local_tensor(param)
            slots.append(ParamSlot(fqn, param, offset, local.numel(), local.shape))
            offset += local.numel()
        reduction = reduction_of(group[0][1]) if reduction_of is not None else None
        size = reduction.size if reduction is not None else dp_size
        padded_numel = -(-offset // size) * size
        device = local_tensor(group[0][1]).device
        bucket = Bucket(index, slots, padded_numel, size, grad_dtype, device, reduction=reduction)
        if not lazy:
            bucket.allocate_grad_buffer()
        buckets.append(bucket)
    return buckets
