"""Periodic checkpoints of a ``vescale train`` run: where they go, which one a restart resumes from.

A run saves ``<checkpoint-dir>/step-NNNNNN`` every ``--save-every`` steps through
``vescale.save(..., async_save=True, defer_copies=True)`` (the ranks go on training while a
background thread copies the parameters, then writes, fsyncs and commits; the loop changes
parameters only in optimizer steps, which wait for the copies) and once, synchronously, at its
end step. dcheckpoint writes each
checkpoint into a hidden directory and renames it when every rank's files are complete, then
points ``latest`` at it (atomically) and only then deletes all but the ``--keep-last`` newest
complete ones: a rank killed at any moment leaves every committed checkpoint whole.

A restarted attempt resumes from the newest *complete* checkpoint: the highest ``step-*``
directory holding an index (``latest`` can lag one behind it when a rank dies between the
rename and the pointer update).

Example::

    saver = PeriodicCheckpoints(Path("ckpt"), save_every=10, keep_last=2, end_step=100)
    if saver.due(step): saver.save(step, state)
    newest_checkpoint(Path("ckpt"))    # (100, Path("ckpt/step-000100"))
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["PeriodicCheckpoints", "newest_checkpoint", "step_directory", "write_json_atomically"]

_STEP_NAME = re.compile(r"step-(\d+)")
_INDEX_NAME = "index.json"


def step_directory(root: Path, step: int) -> Path:
    """The checkpoint directory of global step ``step`` (1-based count of steps done) under ``root``.

    Example::

        step_directory(Path("ckpt"), 20)   # Path("ckpt/step-000020")
    """
    return root / f"step-{step:06d}"


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The highest-step complete checkpoint under ``root`` as ``(step, directory)``, or ``None``.

    Example::

        found = newest_checkpoint(Path("vescale_checkpoints/tiny-llama"))
    """
    if not root.is_dir():
        return None
    complete = [
        (int(match.group(1)), child)
        for child in root.iterdir()
        if (match := _STEP_NAME.fullmatch(child.name)) and (child / _INDEX_NAME).is_file()
    ]
    return max(complete) if complete else None


def write_json_atomically(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file and a rename (never half-written).

    Example::

        write_json_atomically(Path("ckpt/losses.json"), {"steps": [1], "losses": [5.5]})
    """
    pending = path.with_name(f".{path.name}.writing")
    pending.write_text(json.dumps(value))
    os.replace(pending, path)


class PeriodicCheckpoints:
    """Saves due every ``save_every`` steps (async) and at ``end_step`` (synchronous); ``keep_last``.

    ``save_every=0`` saves only at the end step.
    """

    def __init__(self, root: Path, save_every: int, keep_last: int | None, end_step: int) -> None:
        self.root = root
        self.save_every = save_every
        self.keep_last = keep_last
        self.end_step = end_step

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` steps is to be saved."""
        return step == self.end_step or (self.save_every > 0 and step % self.save_every == 0)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Save ``state`` as step ``step`` on every rank: async before the end step, else waited for.

        The save of the previous period is waited for first (its error, if any, is raised here).
        """
        import vescale

        directory = step_directory(self.root, step)
        in_background = step != self.end_step
        vescale.save(
            directory, state, async_save=in_background, keep_last=self.keep_last, defer_copies=in_background
        )
        return directory

    def finish(self) -> None:
        """Wait for the save in flight, if any (every rank, before the process group goes)."""
        from vescale.dcheckpoint.async_save import wait_for_pending_save

        wait_for_pending_save()
