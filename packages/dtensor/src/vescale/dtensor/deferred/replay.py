"""Replay part of a deferred-initialisation record on real CPU tensors.

Only the ops that some asked-for storage depends on run (``InitRecord.ops_for``), so
rebuilding one parameter allocates that parameter and the few small tensors it is computed
from, never the model. A random op draws from a private ``torch.Generator`` set to the
state recorded before it, so the global generator is never touched; an op without a
``generator`` argument borrows the global one and gives its state back.

Example::

    handle = deferred_handle(model.lm_head.weight)
    weight = replay_tensor(handle.record, handle.ref, handle.position)  # the eager values
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from vescale.dtensor.deferred.record import InitRecord, RecordedOp, TensorRef

__all__ = ["release_freed_memory", "replay_storages", "replay_tensor", "tensor_view"]


@functools.cache
def _malloc_trim() -> Any:
    library = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(library), "malloc_trim", None) if library else None


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    A full tensor under glibc's mmap threshold (32 MiB at most) lives on the heap; freed
    between shards that stay, it would leave holes the process keeps resident, so the
    "one full tensor at a time" bound would hold for the allocator but not for RSS.
    """
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)


def tensor_view(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    """The tensor ``ref`` describes, as a view of the real ``storage``."""
    with torch.no_grad():
        return torch.empty(0, dtype=ref.dtype).set_(storage, ref.storage_offset, ref.size, ref.stride)


def _run(recorded: RecordedOp, storages: dict[int, torch.UntypedStorage], record: InitRecord) -> Any:
    def real(value: Any) -> Any:
        if isinstance(value, TensorRef):
            if value.storage_id not in storages:
                # Dropped by ops_for because this op overwrites all of it: any bytes will do.
                nbytes = record.storage_nbytes[value.storage_id]
                storages[value.storage_id] = torch.UntypedStorage(nbytes)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            return tensor_view(storages[value.storage_id], value)
        if isinstance(value, torch.Tensor):
            # A constant of the record: replays must not alias (and so mutate) the record's copy.
            return value.clone()
        return value

    args, kwargs = tree_map(real, (recorded.args, recorded.kwargs))
    if recorded.generator_state is None:
        return recorded.op(*args, **kwargs)
    if recorded.generator_argument:
        generator = torch.Generator()
        generator.set_state(recorded.generator_state)
        return recorded.op(*args, **{**kwargs, "generator": generator})
    global_state = torch.get_rng_state()
    torch.set_rng_state(recorded.generator_state)
    try:
        return recorded.op(*args, **kwargs)
    finally:
        torch.set_rng_state(global_state)


def replay_storages(
    record: InitRecord, storage_ids: set[int], position: int
) -> dict[int, torch.UntypedStorage]:
    """Real storages for ``storage_ids`` as they were after the record's first ``position`` ops.

    Example::

        storages = replay_storages(handle.record, {handle.ref.storage_id}, handle.position)
        weight = tensor_view(storages[handle.ref.storage_id], handle.ref)
    """
    storages: dict[int, torch.UntypedStorage] = {}
    with torch.no_grad():
        for recorded in record.ops_for(storage_ids, position):
            outputs = _run(recorded, storages, record)
            if recorded.created:
                output_leaves, _ = tree_flatten(outputs)
                for output_index, storage_id in recorded.created:
                    storages[storage_id] = output_leaves[output_index].untyped_storage()
    return {storage_id: storages[storage_id] for storage_id in storage_ids}


def replay_tensor(record: InitRecord, ref: TensorRef, position: int) -> torch.Tensor:
    """The real tensor ``ref`` after the record's first ``position`` ops.

    Example::

        handle = deferred_handle(model.weight)
        weight = replay_tensor(handle.record, handle.ref, handle.position)
    """
    storage = replay_storages(record, {ref.storage_id}, position)[ref.storage_id]
    return tensor_view(storage, ref)
