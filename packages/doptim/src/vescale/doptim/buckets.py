"""Contiguous gradient buckets: the parameters of a data-parallel model packed into flat buffers.

Each parameter's local tensor (a DTensor parameter's local shard) occupies one range of its
bucket's flat buffer; a bucket is reduced over the data-parallel group in one collective as
soon as all of its parameters have their gradients. Buckets are filled in reverse
registration order because backward produces the last layers' gradients first. A bucket's
length is padded to a multiple of the data-parallel size so that rank ``r`` owns the equal
chunk ``[r * chunk, (r + 1) * chunk)`` (ZeRO stages 1 and 2); a parameter may straddle
chunks, so each rank holds ragged ranges of some parameters.

Example::

    buckets = build_buckets(named_parameters, bucket_size_bytes=2**20, dp_size=2, grad_dtype=torch.float32)
    slot = buckets[0].slots[0]
    grad_view = buckets[0].grad_view(slot)    # shaped like the parameter's local tensor
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Bucket", "ParamSlot", "build_buckets", "local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
    grad_buffer: torch.Tensor
    # ZeRO-2: this rank's chunk of the averaged bucket (the full buffer is not reduced).
    grad_chunk: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)

    @property
    def chunk_numel(self) -> int:
        """Elements of the bucket each dp rank owns under ZeRO stages 1 and 2."""
        return self.padded_numel // self.dp_size

    def chunk_range(self, dp_rank: int) -> tuple[int, int]:
        """``[start, end)`` of dp rank ``dp_rank``'s chunk of the bucket."""
        return dp_rank * self.chunk_numel, (dp_rank + 1) * self.chunk_numel

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The parameter's gradient inside the bucket, shaped like its local tensor."""
        return self.grad_buffer[slot.offset : slot.offset + slot.numel].view(slot.local_shape)


def build_buckets(
    named_parameters: Sequence[tuple[str, nn.Parameter]],
    *,
    bucket_size_bytes: int,
    dp_size: int,
    grad_dtype: torch.dtype,
) -> list[Bucket]:
    """Pack the parameters, last first, into buckets of at most ``bucket_size_bytes`` and one parameter
    dtype each (one parameter larger than that gets a bucket of its own).

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
        if groups[-1] and (dtype_changes or group_bytes + param_bytes > bucket_size_bytes):
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
        padded_numel = -(-offset // dp_size) * dp_size
        device = local_tensor(group[0][1]).device
        grad_buffer = torch.zeros(padded_numel, dtype=grad_dtype, device=device)
        buckets.append(Bucket(index, slots, padded_numel, dp_size, grad_buffer))
    return buckets
