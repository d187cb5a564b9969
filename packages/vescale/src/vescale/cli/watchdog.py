"""``--timeout``: a training step that makes no progress fails the attempt, with the rank's stacks.

A rank that hangs (a peer stopped, a collective that never completes) would otherwise wait
forever, and torchrun's agent sees nothing wrong. :class:`StepWatchdog` is re-armed at every
step; when a step takes longer than the timeout, a watchdog thread prints which rank and step
stalled, dumps every thread's Python stack (``faulthandler``) and exits with
:data:`TIMEOUT_EXIT_CODE`, so the agent stops the other ranks and restarts the group
(``--max-restarts``). The live ranks of a group stall at different steps, so the first
watchdog to fire usually ends the attempt: the peers' pending collectives then fail, and each
prints its traceback (where it was) instead of this message. The collectives release the GIL
while they wait, so the thread runs; a ``faulthandler`` timer a little later, in C, covers a
rank stuck with the GIL held.

A rank that cannot run at all (stopped with SIGSTOP, or stuck with the GIL held when its peers
give up first) cannot print its own stack: :func:`register_stack_dump` makes
:data:`STACK_DUMP_SIGNAL` print it from C, and the launcher sends that signal (after ``SIGCONT``)
to every rank still alive when it tears down an attempt that stalled
(:mod:`vescale.cli.restart_reports`). The watchdog marks a stall with ``stall_file`` so that
the launcher knows.

Example::

    with StepWatchdog(timeout_s=60, rank=0) as watchdog:
        for step in range(100):
            watchdog.arm(step)
            train_step()
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["STACK_DUMP_SIGNAL", "TIMEOUT_EXIT_CODE", "StepWatchdog", "register_stack_dump"]

TIMEOUT_EXIT_CODE = 3
"""Exit status of a rank the watchdog stopped (the launcher names it in its message)."""

STACK_DUMP_SIGNAL = signal.SIGUSR2
"""The signal on which a rank prints every thread's Python stack (SIGUSR1 is Slurm's usual warning)."""

# The C timer's margin behind the Python thread: the thread's message comes first when it can run.
_FALLBACK_MARGIN_S = 10.0


def register_stack_dump() -> None:
    """Print every thread's Python stack to stderr on :data:`STACK_DUMP_SIGNAL` (from C: no GIL needed).

    Example::

        register_stack_dump()
        os.kill(os.getpid(), STACK_DUMP_SIGNAL)   # prints the stacks, the process runs on
    """
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)


class StepWatchdog:
    """Stops this rank with its stacks when :meth:`arm` is not called again within ``timeout_s``.

    ``stall_file``: created just before the rank exits on a stall, for the launcher to find.
    """

    def __init__(self, timeout_s: float, rank: int, stall_file: Path | None = None) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.stall_file = stall_file
        self._step = 0
        self._armed = threading.Event()
        self._progress = threading.Condition()
        self._generation = 0
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="vescale-step-watchdog", daemon=True)

    def __enter__(self) -> StepWatchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.disarm()
        with self._progress:
            self._closed = True
            self._progress.notify()

    def arm(self, step: int) -> None:
        """Start (or restart) the countdown for global step ``step`` (1-based)."""
        if self.timeout_s <= 0:
            return
        with self._progress:
            self._step = step
            self._generation += 1
            self._armed.set()
            self._progress.notify()
        faulthandler.dump_traceback_later(self.timeout_s + _FALLBACK_MARGIN_S, exit=True, file=sys.stderr)

    def disarm(self) -> None:
        """Stop the countdown (e.g. before the end-of-run save, which has no step to time)."""
        if self.timeout_s <= 0:
            return
        with self._progress:
            self._generation += 1
            self._armed.clear()
            self._progress.notify()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        with self._progress:
            while not self._closed:
                if not self._armed.is_set():
                    self._progress.wait()
                    continue
                generation = self._generation
                self._progress.wait(self.timeout_s)
                if self._generation == generation and self._armed.is_set() and not self._closed:
                    self._fail()

    def _fail(self) -> None:
        if self.stall_file is not None:
            # The marker only adds the other ranks' stacks; the exit status says it all.
            with contextlib.suppress(OSError):
                self.stall_file.touch()
        print(
            f"error: rank {self.rank} made no progress in step {self._step} for {self.timeout_s:g} s "
            "(--timeout); the Python stacks of its threads:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)
