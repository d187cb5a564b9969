"""Commit a checkpoint directory atomically, point ``latest`` at it, and keep the last k.

Shards and index are written into a hidden sibling ``.<name>.saving``; once every file and
the directory are fsynced, one ``rename`` makes the checkpoint appear complete, then
``latest`` is replaced the same way. A save killed at any point therefore leaves either no
``<name>`` (and the previous checkpoints untouched) or a complete one. Pruned checkpoints
are first renamed away, so none is ever seen half-deleted.

Example::

    temporary = prepare_directory(Path("ckpt/step-100"))
    ...                                    # every rank writes into temporary, rank 0 the index last
    commit_directory(temporary, Path("ckpt/step-100")); update_latest(Path("ckpt/step-100"))
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from vescale.dcheckpoint.errors import CheckpointExistsError, CheckpointNotFoundError
from vescale.dcheckpoint.index import INDEX_NAME

__all__ = [
    "LATEST_NAME",
    "commit_directory",
    "fsync_directory",
    "fsync_file",
    "prepare_directory",
    "prune_checkpoints",
    "resolve_checkpoint",
    "temporary_directory",
    "update_latest",
]

LATEST_NAME = "latest"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def temporary_directory(final: Path) -> Path:
    """The hidden sibling a checkpoint is written into before it is renamed to ``final``."""
    return final.parent / f".{final.name}.saving"


def check_not_existing(final: Path) -> None:
    """Refuse to save over an existing checkpoint: replacing it could not be atomic."""
    if final.exists():
        raise CheckpointExistsError(
            f"{str(final)!r} already exists; save each checkpoint to a new path (e.g. step-000100), "
            "or delete the old one first"
        )


def prepare_directory(final: Path) -> Path:
    """Create an empty temporary directory for ``final`` (removing one a killed save left)."""
    temporary = temporary_directory(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    return temporary


def fsync_file(path: Path) -> None:
    """Flush a written file's data and size to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(path: Path) -> None:
    """Flush a directory's entries (file creations and renames) to disk."""
    fsync_file(path)


def commit_directory(temporary: Path, final: Path) -> None:
    """Make the fully written ``temporary`` appear as ``final`` in one rename."""
    fsync_directory(temporary)
    os.rename(temporary, final)
    fsync_directory(final.parent)


def update_latest(final: Path) -> None:
    """Point ``<parent>/latest`` at ``final`` (a one-line file holding its name), atomically."""
    pending = final.parent / f".{LATEST_NAME}.saving"
    pending.write_text(final.name + "\n")
    fsync_file(pending)
    os.replace(pending, final.parent / LATEST_NAME)
    fsync_directory(final.parent)


def _created_ns(directory: Path) -> int | None:
    try:
        created = json.loads((directory / INDEX_NAME).read_bytes()).get("created_ns")
    except (OSError, ValueError, AttributeError):
        return None
    return created if isinstance(created, int) else None


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints in ``root``; return what was deleted."""
    latest = (root / LATEST_NAME).read_text().strip() if (root / LATEST_NAME).exists() else None
    dated = [
        (created, child)
        for child in root.iterdir()
        if child.is_dir() and not child.name.startswith(".")
        if (created := _created_ns(child)) is not None
    ]
    dated.sort(reverse=True)
    # A save killed while pruning leaves a checkpoint renamed away but not yet deleted: finish it.
    for leftover in root.glob(".*.deleting"):
        shutil.rmtree(leftover)
    deleted = []
    for _, child in dated[keep_last:]:
        if child.name == latest:
            continue
        doomed = root / f".{child.name}.deleting"
        os.rename(child, doomed)
        shutil.rmtree(doomed)
        deleted.append(child)
    if deleted:
        fsync_directory(root)
    return deleted


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or what its ``latest`` pointer names."""
    if (path / INDEX_NAME).is_file():
        return path
    pointer = path / LATEST_NAME
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not _PLAIN_NAME.match(name):
            raise CheckpointNotFoundError(
                f"{str(pointer)!r} names {name!r}, which is not a checkpoint in {path}"
            )
        if (path / name / INDEX_NAME).is_file():
            return path / name
        raise CheckpointNotFoundError(
            f"{str(pointer)!r} names {name!r}, but {path / name} holds no {INDEX_NAME}"
        )
    raise CheckpointNotFoundError(
        f"no checkpoint at {str(path)!r}: it holds neither {INDEX_NAME} nor a {LATEST_NAME!r} pointer; "
        "pass the directory save() wrote, or its parent"
    )
