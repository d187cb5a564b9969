"""Saves that return once the state is staged, writing and committing on a background thread.

The caller's thread blocks only for staging (planning and copying this rank's pieces to
CPU, except parameters and optimizer state, which the thread copies first while optimizer
steps wait for it: :mod:`vescale.dcheckpoint.deferred_staging`); the thread checks, writes,
fsyncs and commits. Its collectives run on a process group
of their own, created at the first async save (or ``prepare_async_save``) of each default
group, which all ranks reach together, so they never interleave with the training loop's
collectives on the default group. At most one save is in flight: a new save or a load first
waits for the previous one.

Example::

    pending = save("ckpt/step-000100", state, async_save=True)
    train_step()                      # may change every tensor; the checkpoint will not change
    pending.result()                  # SaveResult, or the save's error
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from vescale.dcheckpoint._collectives import rank_and_world_size
from vescale.dcheckpoint.saving import SaveResult, StagedSave, write_and_commit

__all__ = ["AsyncSave", "background_group", "start_async_save", "wait_for_pending_save"]

_pending: AsyncSave | None = None
# The background thread's group and the default group it was made from: a new default group
# (torch.distributed re-initialised) needs a new one.
# (the default group it was made under, the saving thread's group)
_group: tuple[dist.ProcessGroup | None, dist.ProcessGroup] | None = None


class AsyncSave:
    """A save running in the background: :meth:`done`, :meth:`result`.

    Example::

        pending = save("ckpt/step-000100", state, async_save=True)
        pending.result().path   # waits, then Path("ckpt/step-000100")
    """

    def __init__(self, staged: StagedSave, group: dist.ProcessGroup | None) -> None:
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        # Not a daemon: the interpreter waits for it at exit, so a run's last save still commits.
        self._thread = threading.Thread(
            target=self._run, args=(staged, group), name="vescale-dcheckpoint-save"
        )
        self._thread.start()

    def _run(self, staged: StagedSave, group: dist.ProcessGroup | None) -> None:
        try:
            if staged.deferred is not None:
                staged.deferred.run()
            self._result = write_and_commit(staged, group)
        except BaseException as error:  # handed to the caller by result()
            self._error = error

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the save; return its :class:`SaveResult` or raise its error."""
        global _pending
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the checkpoint save is still running after {timeout} s")
        if _pending is self:  # the caller has its outcome: the next save need not raise it again
            _pending = None
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def wait_for_pending_save() -> None:
    """Wait for the save in flight, if any (its error is raised here if it failed and
    :meth:`AsyncSave.result` did not raise it already)."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.result()


def background_group() -> dist.ProcessGroup | None:
    """The saving thread's process group (created on first use; every rank must call it then)."""
    global _group
    if rank_and_world_size()[1] == 1:
        return None
    if _group is None or _group[0] is not dist.group.WORLD:
        _group = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _group[1]


def start_async_save(staged: StagedSave) -> AsyncSave:
    """Write and commit ``staged`` on a background thread."""
    global _pending
    _pending = AsyncSave(staged, background_group())
    return _pending
