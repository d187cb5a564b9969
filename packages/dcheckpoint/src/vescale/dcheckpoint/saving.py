"""The save pipeline: stage (on the caller's thread), then write and commit (on any thread).

Staging does everything that reads the live state: flatten it, plan who writes what, and
take this rank's pieces (copies for an async save, so that later training steps cannot
change them; with ``defer_copies`` parameters and optimizer state are copied by the saving
thread before it writes, and optimizer steps wait for that, see :mod:`deferred_staging`).
Planning agrees with the other ranks on the tensors each holds (:mod:`rank_sets`: one digest
exchange, or the union of per-rank sets such as pipeline stages'). Writing and committing only
touch the staged pieces and files: rank 0 prepares the directory, each
rank writes and fsyncs its shard, the ranks exchange their file records, rank 0 writes the
index last and commits, and every rank learns the outcome, so a failure on any rank fails
the save on all of them.

Example::

    staged = stage_save(Path("ckpt/step-100"), state, keep_last=None, copy=False)
    result = write_and_commit(staged)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale.dcheckpoint import atomic
from vescale.dcheckpoint._collectives import all_gather_bytes, rank_and_world_size
from vescale.dcheckpoint.deferred_staging import DeferredCopies, deferrable_names
from vescale.dcheckpoint.errors import CheckpointError
from vescale.dcheckpoint.index import INDEX_NAME, chunk_key, encode_index, shard_file_name
from vescale.dcheckpoint.layout import TensorLayout
from vescale.dcheckpoint.rank_sets import agree_layouts, describe_layouts, plan_union_chunks
from vescale.dcheckpoint.rng import RNGState
from vescale.dcheckpoint.state import RNG, flatten_state, merge_objects
from vescale.dcheckpoint.writer import (
    PlannedChunk,
    plan_chunks,
    reserve_staging,
    stage_pieces,
    write_shard_file,
)

__all__ = ["SaveResult", "StagedSave", "prepare_staging", "stage_save", "write_and_commit"]


@dataclass(frozen=True)
class SaveResult:
    """Where the checkpoint was committed and how many tensor bytes this rank wrote."""

    path: Path
    bytes_written: int


@dataclass(frozen=True)
class StagedSave:
    """Everything a save needs after the live state may change again."""

    final: Path
    rank: int
    world_size: int
    plan: list[PlannedChunk]
    mine: list[PlannedChunk]
    pieces: list[torch.Tensor]
    entries: dict[str, dict[str, Any]]
    objects: dict[str, Any]
    merge_objects: bool
    rng: dict[str, Any] | None
    keep_last: int | None
    # Async saves: the parameter and optimizer-state copies the saving thread takes before writing.
    deferred: DeferredCopies | None = None


def _plan_save(
    layouts: dict[str, TensorLayout], dtypes: dict[str, torch.dtype], plain: frozenset[str]
) -> tuple[list[PlannedChunk], dict[str, dict[str, Any]], bool]:
    """The chunks every rank writes, each tensor's index entry (without chunks), and whether the
    ranks hold different tensors (then their JSON state is merged too). Collective."""
    description = describe_layouts(layouts, dtypes, plain)
    union = agree_layouts(description)
    if union is None:
        return plan_chunks(layouts, dtypes), _entries(description), False
    return plan_union_chunks(union), _entries({name: held[0][0] for name, held in union.items()}), True


def _entries(description: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    # The layout a tensor was saved from is informational: loads reshard from the chunks.
    return {
        name: {"shape": shape, "dtype": dtype, "mesh_shape": mesh_shape, "placements": placements}
        for name, (shape, dtype, mesh_shape, _, placements, _) in description.items()
    }


def stage_save(
    final: Path, state: dict[str, Any], keep_last: int | None, copy: bool, defer_copies: bool = False
) -> StagedSave:
    """Check ``state``, plan the save and take this rank's pieces (``defer_copies``: leave the
    parameters' and optimizer state's copies to the saving thread, see :mod:`deferred_staging`).

    Example::

        staged = stage_save(Path("ckpt/step-100"), {"model": model}, keep_last=2, copy=True)
        len(staged.pieces)   # the chunks this rank writes
    """
    rank, world_size = rank_and_world_size()
    atomic.check_not_existing(final)
    tensors, objects = flatten_state(state)
    locals_by_name = {name: t.to_local() if isinstance(t, DTensor) else t for name, t in tensors.items()}
    layouts = {
        name: TensorLayout.of(tensor, world_size, name, locals_by_name[name])
        for name, tensor in tensors.items()
    }
    dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
    plain = frozenset(name for name, tensor in tensors.items() if not isinstance(tensor, DTensor))
    plan, entries, per_rank = _plan_save(layouts, dtypes, plain)
    mine = [chunk for chunk in plan if chunk.writer_rank == rank]
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    deferred = deferrable_names(state, tensors) if copy and defer_copies else frozenset()
    pieces = stage_pieces(mine, locals_by_name, layouts, rank, copy=copy, deferred=deferred, pending=pending)
    rng = RNGState.capture() if any(entry["kind"] == RNG for entry in objects.values()) else None
    # JSON now, so that later changes to the live objects cannot reach an async save.
    objects = json.loads(json.dumps(objects))
    copies = DeferredCopies(pending) if pending else None
    return StagedSave(
        final, rank, world_size, plan, mine, pieces, entries, objects, per_rank, rng, keep_last, copies
    )


def prepare_staging(state: dict[str, Any]) -> int:
    """Reserve the staging memory an async save of ``state`` needs on this rank; return its size.

    Example::

        prepare_staging({"model": model, "optimizer": optimizer})   # bytes now resident
    """
    rank, world_size = rank_and_world_size()
    tensors, _ = flatten_state(state)
    layouts = {
        name: TensorLayout.of(
            tensor, world_size, name, tensor.to_local() if isinstance(tensor, DTensor) else tensor
        )
        for name, tensor in tensors.items()
    }
    dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
    plain = frozenset(name for name, tensor in tensors.items() if not isinstance(tensor, DTensor))
    plan, _, _ = _plan_save(layouts, dtypes, plain)
    return reserve_staging([chunk for chunk in plan if chunk.writer_rank == rank])


def _index_body(staged: StagedSave, payloads: list[dict[str, Any]]) -> dict[str, Any]:
    boxes = {chunk_key(chunk.name, chunk.box): chunk.box for chunk in staged.plan}
    files: list[dict[str, Any]] = []
    chunks_by_name: dict[str, list[dict[str, Any]]] = {name: [] for name in staged.entries}
    for payload in payloads:
        record = payload["file"]
        if record is None:
            continue
        # Chunks name their file by its position in "files", which keeps small tensors' entries small.
        file_number = len(files)
        files.append({"name": record["file"], "size": record["size"], "header_crc32": record["header_crc32"]})
        for name, key, start, end, crc in record["chunks"]:
            box = boxes[key]
            chunks_by_name[name].append(
                {
                    "offsets": list(box.offsets),
                    "sizes": list(box.sizes),
                    "file": file_number,
                    "byte_range": [start, end],
                    "crc32": crc,
                }
            )
    tensors = {name: {**entry, "chunks": chunks_by_name[name]} for name, entry in staged.entries.items()}
    objects = staged.objects
    if staged.merge_objects:
        objects = merge_objects([payload["objects"] for payload in payloads])
    rng_states = [payload["rng"] for payload in payloads]
    return {
        "world_size": len(payloads),
        "created_ns": time.time_ns(),
        "files": files,
        "tensors": tensors,
        "objects": objects,
        "rng": rng_states if any(state is not None for state in rng_states) else None,
    }


def _commit(staged: StagedSave, payloads: list[dict[str, Any]]) -> None:
    temporary = atomic.temporary_directory(staged.final)
    (temporary / INDEX_NAME).write_bytes(encode_index(_index_body(staged, payloads)))
    atomic.fsync_file(temporary / INDEX_NAME)
    atomic.commit_directory(temporary, staged.final)
    atomic.update_latest(staged.final)
    if staged.keep_last is not None:
        atomic.prune_checkpoints(staged.final.parent, staged.keep_last)


def _raise_if_any_failed(messages: list[str | None], error: BaseException | None) -> None:
    if error is not None:
        raise error
    failed = [(other, message) for other, message in enumerate(messages) if message]
    if failed:
        other, message = failed[0]
        raise CheckpointError(f"rank {other} failed during the save, which was not committed: {message}")


def _prepare_directory(staged: StagedSave, group: dist.ProcessGroup | None) -> None:
    # Rank 0 clears what a killed save left and creates the temporary directory; every rank
    # learns the outcome before writing into it.
    failure = None
    if staged.rank == 0:
        try:
            atomic.prepare_directory(staged.final)
        except OSError as error:
            failure = error
    outcomes = all_gather_bytes(b"" if failure is None else repr(failure).encode(), group)
    _raise_if_any_failed([outcome.decode() for outcome in outcomes], failure)


def write_and_commit(staged: StagedSave, group: dist.ProcessGroup | None = None) -> SaveResult:
    """Prepare the directory, write this rank's shard, exchange records over ``group``, let rank 0 commit.

    Example::

        result = write_and_commit(stage_save(Path("ckpt/step-100"), state, keep_last=None, copy=False))
        result.bytes_written
    """
    _prepare_directory(staged, group)
    record, failure = None, None
    try:
        if staged.mine:
            shard_path = atomic.temporary_directory(staged.final) / shard_file_name(
                staged.rank, staged.world_size
            )
            record = write_shard_file(shard_path, staged.mine, staged.pieces)
            atomic.fsync_file(shard_path)
    except (OSError, CheckpointError) as error:
        failure = error
    payload = {"file": record, "rng": staged.rng, "error": None if failure is None else repr(failure)}
    if staged.merge_objects:
        # Ranks with different tensors have different JSON state too (pipeline stages' optimizer groups).
        payload["objects"] = staged.objects
    payloads = [json.loads(raw) for raw in all_gather_bytes(json.dumps(payload).encode(), group)]
    _raise_if_any_failed([p["error"] for p in payloads], failure)
    commit_failure = None
    if staged.rank == 0:
        try:
            _commit(staged, payloads)
        except (OSError, CheckpointError) as error:
            commit_failure = error
    outcomes = all_gather_bytes(b"" if commit_failure is None else repr(commit_failure).encode(), group)
    _raise_if_any_failed([outcome.decode() for outcome in outcomes], commit_failure)
    return SaveResult(staged.final, sum(chunk.nbytes for chunk in staged.mine))
