"""What the launcher says when an attempt fails: which rank died, how, and which attempt comes next.

torchrun's elastic agent (``torch.distributed.run``) watches the ranks; when one exits with an
error it stops the others and, while ``--max-restarts`` allows, starts them all again. It tells
this only through its loggers: the multiprocessing logger records the first failed rank (exit
status, local rank), the agent's logger each restart. :class:`RestartReporter` listens to those
two records and prints one line per failed attempt::

    attempt 1 failed: rank 2 was killed by SIGKILL; restarting every rank (attempt 2 of 3),
    resuming from the newest complete checkpoint

The restarted rank 0 then prints the step it resumed from.

Example::

    with RestartReporter(node_rank=0, nproc=4, max_restarts=2).listening():
        torchrun.run(arguments)
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from vescale.cli.watchdog import TIMEOUT_EXIT_CODE

__all__ = ["RestartReporter", "describe_exit"]

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


class RestartReporter(logging.Handler):
    """Turns the agent's failure and restart records into the lines described in the module docstring."""

    def __init__(self, node_rank: int, nproc: int, max_restarts: int) -> None:
        super().__init__(logging.INFO)
        self.node_rank = node_rank
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.attempt = 1
        self.failure: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        arguments = record.args if isinstance(record.args, tuple) else ()
        if message.startswith("failed (exitcode") and len(arguments) >= 2:
            exit_code, local_rank = arguments[0], arguments[1]
            if isinstance(exit_code, int) and isinstance(local_rank, int):
                rank = self.node_rank * self.nproc + local_rank
                self.failure = f"rank {rank} {describe_exit(exit_code)}"
        elif "will restart worker group" in message:
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
