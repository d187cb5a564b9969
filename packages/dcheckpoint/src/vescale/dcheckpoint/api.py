"""``save`` and ``load``: the public entry points of ``vescale.dcheckpoint``.

Example::

    state = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler, "rng": RNGState()}
    save("ckpt/step-000100", state, keep_last=3)
    load("ckpt", state)   # the checkpoint ckpt/latest names, resharded to this run's layout
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vescale.dcheckpoint import atomic
from vescale.dcheckpoint._collectives import rank_and_world_size
from vescale.dcheckpoint._gc import gc_paused
from vescale.dcheckpoint.async_save import (
    AsyncSave,
    background_group,
    start_async_save,
    wait_for_pending_save,
)
from vescale.dcheckpoint.errors import CheckpointFormatError, CheckpointMismatchError, CheckpointUsageError
from vescale.dcheckpoint.index import INDEX_NAME, CheckpointIndex, parse_index
from vescale.dcheckpoint.layout import TensorLayout
from vescale.dcheckpoint.reader import ReadStats, ShardReader
from vescale.dcheckpoint.rng import RNGState
from vescale.dcheckpoint.saving import SaveResult, prepare_staging, stage_save, write_and_commit
from vescale.dcheckpoint.shared_reads import SharedReads
from vescale.dcheckpoint.state import plan_restore

__all__ = [
    "AsyncSave",
    "LoadResult",
    "SaveResult",
    "load",
    "prepare_async_save",
    "read_index",
    "read_targets",
    "save",
]

logger = logging.getLogger("vescale.dcheckpoint")

# An index larger than this is refused before it is read into memory.
MAX_INDEX_BYTES = 1 << 30


@dataclass(frozen=True)
class LoadResult:
    """Which checkpoint was loaded and what this rank read (:class:`ReadStats`)."""

    path: Path
    stats: ReadStats


def save(
    path: str | os.PathLike[str],
    state: dict[str, Any],
    *,
    async_save: bool = False,
    keep_last: int | None = None,
    defer_copies: bool = False,
) -> SaveResult | AsyncSave:
    """Save ``state`` to the new checkpoint directory ``path``, atomically, from every rank.

    Every rank calls it; ranks may hold different tensors (pipeline stages), each name with one
    global shape and dtype, and each box is written once. The parent directory gets a
    ``latest`` pointer; ``keep_last=k`` deletes all but the k newest checkpoints there.
    With ``async_save=True`` it returns an :class:`AsyncSave` once this rank's tensors are
    copied; later changes to the state do not reach the checkpoint. ``defer_copies=True`` (async
    only) returns before the parameters and optimizer state are copied: the saving thread copies
    them while the next forward and backward run, and every optimizer ``step()`` waits for the
    copies, so the first async save of a process does not block on faulting in its staging
    memory (:mod:`vescale.dcheckpoint.deferred_staging`); until ``step()`` returns, change
    parameters and optimizer state only through optimizer steps.

    Example::

        save("ckpt/step-000100", {"model": model, "optimizer": optimizer, "step": 100})
        pending = save("ckpt/step-000200", {"model": model, "step": 200}, async_save=True, keep_last=2)
        save("ckpt/step-000300", {"model": model, "optimizer": optimizer}, async_save=True, defer_copies=True)
    """
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointUsageError(
            f"keep_last={keep_last!r}: keep at least the checkpoint just saved (keep_last >= 1), or pass None"
        )
    if defer_copies and not async_save:
        raise CheckpointUsageError(
            "defer_copies=True defers the copies of an async save; pass async_save=True too, or drop it"
        )
    wait_for_pending_save()
    with gc_paused():
        staged = stage_save(Path(path), state, keep_last, copy=async_save, defer_copies=defer_copies)
        if async_save:
            return start_async_save(staged)
        return write_and_commit(staged)


def prepare_async_save(state: dict[str, Any]) -> int:
    """Reserve now the memory that async saves of ``state`` copy into; return its bytes on this rank.

    Optional: call it once at start-up, on every rank (it also creates the saving thread's
    process group), and the first ``save(..., async_save=True)`` blocks only for the copy, like
    every later one, instead of also faulting in fresh memory. Later saves reuse it either way.

    Example::

        prepare_async_save({"model": model, "optimizer": optimizer})
        pending = save("ckpt/step-000100", {"model": model, "optimizer": optimizer}, async_save=True)
    """
    wait_for_pending_save()
    background_group()
    with gc_paused():
        return prepare_staging(state)


def read_index(directory: Path) -> CheckpointIndex:
    """Parse and validate the index of the checkpoint directory ``directory``.

    Example::

        index = read_index(Path("ckpt/step-000100"))
        index.tensors["model/fc.weight"].shape
    """
    path = directory / INDEX_NAME
    if path.stat().st_size > MAX_INDEX_BYTES:
        raise CheckpointFormatError(
            f"{str(path)!r} is larger than {MAX_INDEX_BYTES} bytes; it is not an index"
        )
    return parse_index(path.read_bytes(), str(path))


def _restore_rng(index: CheckpointIndex, rank: int, world_size: int) -> None:
    if not index.rng:
        raise CheckpointMismatchError('the checkpoint holds no rng states; remove "rng" from the state')
    if len(index.rng) != world_size:
        logger.warning(
            "rng states were saved by %d ranks, loading on %d: rank %d gets rank %d's states",
            len(index.rng),
            world_size,
            rank,
            rank % len(index.rng),
        )
    RNGState.restore(index.rng[rank % len(index.rng)])


def load(path: str | os.PathLike[str], state: dict[str, Any], *, strict: bool = True) -> LoadResult:
    """Load a checkpoint into ``state`` in place, resharding every tensor to its current layout.

    ``path`` is a checkpoint directory or its parent (then ``latest`` names the checkpoint).
    With ``strict`` (the default), keys missing on either side are an error.

    Example::

        state = {"model": model, "optimizer": optimizer}
        result = load("ckpt", state)
        result.stats.bytes_read / result.stats.bytes_needed
    """
    wait_for_pending_save()
    with gc_paused():
        return _load(Path(path), state, strict)


def _load(path: Path, state: dict[str, Any], strict: bool) -> LoadResult:
    directory = atomic.resolve_checkpoint(path)
    index = read_index(directory)
    restore = plan_restore(state, index, strict)
    restore.check_keys(strict)
    stats = read_targets(directory, index, restore.targets)
    restore.apply()
    if restore.restore_rng:
        rank, world_size = rank_and_world_size()
        _restore_rng(index, rank, world_size)
    return LoadResult(directory, stats)


def read_targets(directory: Path, index: CheckpointIndex, targets: dict[str, torch.Tensor]) -> ReadStats:
    """Fill every target (a DTensor or plain tensor of the saved shape and dtype) from ``index``.

    Each rank reads the byte ranges of the boxes only it holds; boxes several ranks hold are
    read once and sent (:mod:`shared_reads`). Every rank must call it; their targets may differ.

    Example::

        stats = read_targets(directory, index, {"model/fc.weight": model.fc.weight})
        stats.bytes_read / stats.bytes_needed
    """
    rank, world_size = rank_and_world_size()
    locals_by_name = {
        name: target.to_local() if isinstance(target, DTensor) else target for name, target in targets.items()
    }
    layouts = {
        name: TensorLayout.of(target, world_size, name, locals_by_name[name])
        for name, target in targets.items()
    }
    plain = frozenset(name for name, target in targets.items() if not isinstance(target, DTensor))
    shared = SharedReads.plan(layouts, {name: t.dtype for name, t in targets.items()}, rank, plain)
    with ShardReader(directory, index) as reader, torch.no_grad():
        for name, layout in layouts.items():
            own = [box for box in layout.local_boxes(rank) if not shared.is_shared(name, box.box)]
            reader.read_into(index.tensors[name], locals_by_name[name], own)
        shared.exchange(reader, index, locals_by_name, layouts)
    return reader.stats
