"""The few collectives a save needs, over the default process group, without pickle.

``torch.distributed.all_gather_object`` pickles; these exchange raw bytes in uint8 tensors.
Without an initialised process group the caller is the only rank.

Example::

    rank, world_size = rank_and_world_size()
    payloads = all_gather_bytes(json.dumps(my_record).encode())   # one bytes per rank
    differing = gather_if_different(json.dumps(my_names).encode())  # None when every rank agrees
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from vescale.dtensor.mesh import device_type_for_backend

__all__ = ["all_gather_bytes", "gather_if_different", "rank_and_world_size"]


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size (``(0, 1)`` without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_bytes(payload: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order (over ``group``, by default the default group)."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return [payload]
    device = device_type_for_backend(dist.get_backend(group))
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(item.item()) for item in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return [
        bytes(item.cpu().numpy()[: int(size.item())]) for item, size in zip(gathered, lengths, strict=True)
    ]


def gather_if_different(payload: bytes, group: dist.ProcessGroup | None = None) -> list[bytes] | None:
    """``None`` when every rank holds the same ``payload``, else every rank's payload in rank order.

    The ranks first exchange digests: when they agree (the common case, and the only one
    before pipeline stages or per-rank state), only 32 bytes per rank cross the wire.
    """
    digests = all_gather_bytes(hashlib.sha256(payload).digest(), group)
    if all(digest == digests[0] for digest in digests):
        return None
    return all_gather_bytes(payload, group)
