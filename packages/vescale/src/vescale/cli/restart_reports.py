"""What the launcher says when an attempt fails: which rank died, how, and which attempt comes next.

torchrun's elastic agent (``torch.distributed.run``) watches the ranks; when one exits with an
error it stops the others and, while ``--max-restarts`` allows, starts them all again. It tells
this only through its loggers: the multiprocessing logger records the first failed rank (exit
status, local rank), the agent's logger each restart. :class:`RestartReporter` listens to those
two records and prints one line per failed attempt::

    attempt 1 failed: rank 2 was killed by SIGKILL; restarting every rank (attempt 2 of 3),
    resuming from the newest complete checkpoint

The restarted rank 0 then prints the step it resumed from.

Two more decisions are taken on those records, before the agent acts on them:

* a **user error** (a rank wrote the run's error file: a bad constraint, a checkpoint that does
  not fit) is not retried: the same error would come back in every attempt. The reporter stops
  the agent with :class:`UserErrorStop` instead of letting it restart, and the launcher prints
  the error once;
* when the agent tears down an attempt, every worker still alive that is **stopped** (SIGSTOP)
  or, after a ``--timeout`` stall, still running, is sent ``SIGCONT`` and
  :data:`~vescale.cli.watchdog.STACK_DUMP_SIGNAL`: it prints its Python stack, and the agent's
  SIGTERM then ends it at once (a stopped process would keep the SIGTERM pending through the
  agent's 30 s grace, and be SIGKILLed without a word).

Example::

    with RestartReporter(node_rank=0, nproc=4, max_restarts=2).listening():
        torchrun.run(arguments)
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from vescale.cli.train_options import ERROR_FILE_NAME, STALL_FILE_NAME
from vescale.cli.watchdog import STACK_DUMP_SIGNAL, TIMEOUT_EXIT_CODE

__all__ = ["RestartReporter", "UserErrorStop", "describe_exit", "process_state"]

_PROCESS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def describe_exit(exit_code: int) -> str:
    """How a rank ended, in words: a signal's name, the watchdog's timeout, or the exit status.

    Example::

        describe_exit(-9)   # 'was killed by SIGKILL'
    """
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    if exit_code == TIMEOUT_EXIT_CODE:
        return "made no progress within --timeout (stacks above)"
    return f"exited with status {exit_code} (its traceback is above)"


# The time a resumed rank gets to write its stack before the agent's SIGTERM (a few ms are needed).
_STACK_DUMP_WAIT_S = 0.5


class UserErrorStop(Exception):
    """Raised through the agent when a rank reported a user error: no restart, the error is printed once."""


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z``...), or ``None`` if unknown.

    Read from ``/proc`` (Linux); elsewhere ``None``.

    Example::

        process_state(os.getpid())   # 'R'
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (command) state ...": the command may hold spaces and parentheses.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0] if fields else None


def _global_rank(pid: int) -> str:
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    for variable in environment:
        if variable.startswith(b"RANK="):
            return f"rank {variable[5:].decode()} (pid {pid})"
    return f"pid {pid}"


class RestartReporter(logging.Handler):
    """Turns the agent's failure and restart records into the lines described in the module docstring.

    ``run_dir``: the launch's directory, where a rank's user error (:data:`ERROR_FILE_NAME`) and
    the watchdog's stall marker (:data:`STALL_FILE_NAME`) appear.
    """

    def __init__(self, node_rank: int, nproc: int, max_restarts: int, run_dir: Path | None = None) -> None:
        super().__init__(logging.INFO)
        self.node_rank = node_rank
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.run_dir = run_dir
        self.attempt = 1
        self.failure: str | None = None

    @property
    def error_file(self) -> Path | None:
        """Where the first rank that meets a user error writes its line."""
        return self.run_dir / ERROR_FILE_NAME if self.run_dir is not None else None

    @property
    def stall_file(self) -> Path | None:
        """Created by a rank's watchdog when a step made no progress within ``--timeout``."""
        return self.run_dir / STALL_FILE_NAME if self.run_dir is not None else None

    def _dump_stack(self, pid: int) -> None:
        """Before the agent's SIGTERM reaches ``pid``: resume it if stopped, and have it print its stack."""
        state = process_state(pid)
        stalled = self.stall_file is not None and self.stall_file.exists()
        if state is None or state in "ZXx" or not (state in "Tt" or stalled):
            return
        why = "is stopped (SIGSTOP)" if state in "Tt" else "is still running"
        print(f"{_global_rank(pid)} {why}; its Python stack:", file=sys.stderr, flush=True)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, STACK_DUMP_SIGNAL)
            time.sleep(_STACK_DUMP_WAIT_S)

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        arguments = record.args if isinstance(record.args, tuple) else ()
        if message.startswith("Sending process") and arguments and isinstance(arguments[0], int):
            self._dump_stack(arguments[0])
        elif message.startswith("failed (exitcode") and len(arguments) >= 2:
            exit_code, local_rank = arguments[0], arguments[1]
            if isinstance(exit_code, int) and isinstance(local_rank, int):
                rank = self.node_rank * self.nproc + local_rank
                self.failure = f"rank {rank} {describe_exit(exit_code)}"
        elif "will restart worker group" in message:
            if self.error_file is not None and self.error_file.is_file():
                raise UserErrorStop(self.error_file.read_text().strip())
            if self.stall_file is not None:
                self.stall_file.unlink(missing_ok=True)
            what = self.failure or "a rank failed"
            self.attempt += 1
            print(
                f"attempt {self.attempt - 1} failed: {what}; restarting every rank (attempt "
                f"{self.attempt} of {self.max_restarts + 1}), resuming from the newest complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
            self.failure = None

    @contextmanager
    def listening(self) -> Iterator[RestartReporter]:
        """Attach to the agent's two loggers (and keep their other records quiet) for the block."""
        loggers = [logging.getLogger(_PROCESS_LOGGER), logging.getLogger(_AGENT_LOGGER)]
        saved = [(logger.level, logger.propagate) for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.INFO)
            logger.propagate = False
            logger.addHandler(self)
        try:
            yield self
        finally:
            for logger, (level, propagate) in zip(loggers, saved, strict=True):
                logger.removeHandler(self)
                logger.setLevel(level)
                logger.propagate = propagate
