"""Errors raised by the multi-process test harness.

A rank's own exception is re-raised as itself (so ``pytest.raises(ValueError)`` works
around a multi-rank call) with its rank in a note and its traceback chained as a
:class:`RemoteTraceback`. The classes here cover what is not a rank's own exception.

Example::

    try:
        run_on_ranks(body, world_size=4, timeout=5)
    except RankTimeoutError as error:
        print(error.stacks[1])          # where rank 1 was stuck
"""

from __future__ import annotations

__all__ = [
    "DistributedTestError",
    "NestedRankRunError",
    "RankCrashedError",
    "RankFailedError",
    "RankTimeoutError",
    "RemoteTraceback",
]


class DistributedTestError(Exception):
    """Base class of the harness's own errors."""


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback; chained as the ``__cause__`` of its exception."""

    def __init__(self, rank: int, traceback_text: str) -> None:
        super().__init__(f"traceback on rank {rank}:\n{traceback_text}")
        self.rank = rank
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        message: str = self.args[0]
        return message


class RankFailedError(DistributedTestError):
    """A rank raised an exception that could not be sent back as itself (it does not pickle)."""

    def __init__(self, rank: int, exception_type: str, message: str, traceback_text: str) -> None:
        super().__init__(f"rank {rank} raised {exception_type}: {message}\n{traceback_text}")
        self.rank = rank
        self.exception_type = exception_type
        self.traceback_text = traceback_text


class RankTimeoutError(DistributedTestError):
    """Ranks did not finish within the timeout; ``stacks`` maps each such rank to its Python stacks."""

    def __init__(self, message: str, stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.stacks = stacks


class RankCrashedError(DistributedTestError):
    """A rank process died (signal, ``os._exit``, interpreter crash) instead of returning."""

    def __init__(self, message: str, rank: int, exit_code: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


class NestedRankRunError(DistributedTestError):
    """``run_on_ranks`` was called inside a rank process.

    A rank cannot start ranks of its own: they would wait forever for the machine-wide rank
    lock that their parent's run holds. The usual cause is a script that defines the rank
    function and calls ``run_on_ranks`` at import time: each rank imports the script to find
    the function and runs it again.
    """
