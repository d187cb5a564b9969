"""A pool of rank processes kept alive across tests.

Importing torch (and transformers) costs seconds per process; a test that spawns its ranks
pays that every time. The pool pays it once per rank process: each run sends the ranks a
:class:`RunRequest`, they build a new gloo process group over a fresh ``file://`` store,
run the function, destroy the group and reply. A run that times out, crashes or leaves
ranks stuck after another rank's failure kills the whole pool (process groups included);
the next run starts new ranks.

Destroying a process group does not free it while objects of the run still refer to it
(torch's own redistribute-planner cache keeps every mesh it has seen), and each leaked gloo
group keeps three threads that wake up and burn CPU: ranks of ~750 threads ran at 20-27% of a
core between runs of a CI suite. A pool whose ranks report more than
``RECYCLE_AFTER_THREADS`` threads after a run is closed, so the next run starts new ranks.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from vescale.dtensor.testing._function_ref import FunctionRef
from vescale.dtensor.testing._protocol import READY, SHUTDOWN, RunReply, RunRequest
from vescale.dtensor.testing.errors import (
    DistributedTestError,
    NestedRankRunError,
    RankCrashedError,
    RankFailedError,
    RankTimeoutError,
    RemoteTraceback,
)

__all__ = ["MAX_WORLD_SIZE", "RECYCLE_AFTER_THREADS", "RankPool", "mark_rank_process"]

MAX_WORLD_SIZE = 8
# A fresh rank has ~4 threads, and each leaked gloo process group adds 3 (see the docstring).
RECYCLE_AFTER_THREADS = 64
STARTUP_TIMEOUT_S = 300.0
STACK_DUMP_WAIT_S = 2.0
# Multi-rank runs of every test process on this machine take turns through this lock, so
# that two pytest-xdist workers never run 2 x 4 busy ranks on 2 cores. "none" turns it off.
RANK_LOCK_ENV = "VESCALE_TEST_RANK_LOCK"
# True in a rank process (set by its worker loop): a run started there could never take the lock.
_inside_rank_process = False


def mark_rank_process() -> None:
    """Record that this process is a rank of a pool (called once by the rank worker)."""
    global _inside_rank_process
    _inside_rank_process = True


def _reply_value(reply: RunReply, rank: int) -> bytes:
    if reply.value is None:  # a rank that succeeded always sends its pickled return value
        raise DistributedTestError(f"rank {rank} reported success but sent no return value")
    return reply.value


@dataclass
class _RankProcess:
    process: subprocess.Popen[bytes]
    connection: Connection
    output_file: str
    stack_file: str

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: takes its children too
        self.process.wait()
        self.connection.close()

    def exit_code(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout=1.0)
        return None

    def read_output(self) -> str:
        with open(self.output_file, encoding="utf-8", errors="replace") as output:
            return output.read()

    def dump_stacks(self) -> str:
        """Ask the rank for its Python stacks (SIGUSR1 -> faulthandler) and return them."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGUSR1)
        deadline, last_size = time.monotonic() + STACK_DUMP_WAIT_S, -1
        while time.monotonic() < deadline:
            size = os.path.getsize(self.stack_file)
            if size > 0 and size == last_size:
                break
            last_size = size
            time.sleep(0.05)
        with open(self.stack_file, encoding="utf-8", errors="replace") as stacks:
            return stacks.read() or "(no stack was written: the process did not answer SIGUSR1)"


def _describe_exit(exit_code: int | None) -> str:
    if exit_code is None:
        return "stopped answering"
    if exit_code < 0:
        return f"was killed by {signal.Signals(-exit_code).name}"
    return f"exited with code {exit_code}"


@contextlib.contextmanager
def _machine_wide_rank_lock() -> Iterator[None]:
    lock_path = os.environ.get(RANK_LOCK_ENV, os.path.join(tempfile.gettempdir(), "vescale-test-ranks.lock"))
    if lock_path.lower() == "none":
        yield
        return
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


class RankPool:
    """Rank processes that run module-level functions in new process groups.

    Example::

        pool = RankPool()
        sums = pool.run(all_reduce_ones, world_size=4)   # [4.0, 4.0, 4.0, 4.0]
        pool.close()
    """

    def __init__(self) -> None:
        self._directory = tempfile.mkdtemp(prefix="vescale-ranks-")
        self._ranks: list[_RankProcess] = []
        self._run_numbers = itertools.count()

    @property
    def pids(self) -> list[int]:
        """The process ids of the live rank processes, rank 0 first."""
        return [rank.process.pid for rank in self._ranks]

    def run(
        self,
        function: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout_s: float,
        backend: str,
        seed: int,
        error_grace_s: float,
    ) -> list[Any]:
        """Run ``function(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result."""
        if _inside_rank_process:
            raise NestedRankRunError(
                f"run_on_ranks({getattr(function, '__qualname__', function)!r}) was called inside a rank "
                "process, whose ranks would wait forever for the machine-wide rank lock; if a script "
                "defines the rank function and calls run_on_ranks at import time, put that call under "
                '`if __name__ == "__main__":` (each rank imports the script to find the function)'
            )
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(
                f"world_size={world_size} is outside 1..{MAX_WORLD_SIZE}, the ranks this harness runs"
            )
        reference = FunctionRef.of(function)
        arguments = pickle.dumps((tuple(args), dict(kwargs or {})))
        self._grow(world_size)
        with _machine_wide_rank_lock():
            store_path = os.path.join(self._directory, f"store-{next(self._run_numbers)}")
            try:
                for rank in range(world_size):
                    request = RunRequest(
                        reference, arguments, rank, world_size, backend, store_path, timeout_s, seed
                    )
                    self._ranks[rank].connection.send(request)
                replies, failure = self._collect(reference, world_size, timeout_s, error_grace_s)
            except BaseException:
                self.close(kill=True)  # interrupted (e.g. Ctrl-C): no rank may run on
                raise
        if failure is not None:
            raise failure
        if max(reply.threads for reply in replies.values()) > RECYCLE_AFTER_THREADS:
            self.close()  # leaked process groups' threads (see the module docstring)
        return [pickle.loads(_reply_value(replies[rank], rank)) for rank in range(world_size)]

    def close(self, *, kill: bool = False) -> None:
        """Stop every rank process (politely unless ``kill``) and forget them."""
        for rank in self._ranks:
            if not kill:
                with contextlib.suppress(OSError):
                    rank.connection.send(SHUTDOWN)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rank.process.wait(timeout=5.0)
            rank.kill()
        self._ranks = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close(kill=True)
            shutil.rmtree(self._directory, ignore_errors=True)

    def _grow(self, world_size: int) -> None:
        new_ranks = [self._start_rank(index) for index in range(len(self._ranks), world_size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank in new_ranks:
            ready = rank.connection.poll(max(0.0, deadline - time.monotonic()))
            message = rank.connection.recv() if ready else None
            if message != READY:
                for started in new_ranks:
                    started.kill()
                raise DistributedTestError(
                    f"a rank process failed to start; its output:\n{rank.read_output()}"
                )
        self._ranks.extend(new_ranks)

    def _start_rank(self, index: int) -> _RankProcess:
        parent_end, child_end = socket.socketpair()
        output_file = os.path.join(self._directory, f"rank-{index}.out")
        stack_file = os.path.join(self._directory, f"rank-{index}.stacks")
        environment = {
            **os.environ,
            "OMP_NUM_THREADS": "1",  # one thread per rank: 4 ranks on 2 cores must not thrash
            "MKL_NUM_THREADS": "1",
            # torch.compile in a rank compiles in that process: a long-lived rank must not keep
            # inductor's pool of compile workers (hundreds of threads) for every later test.
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "VESCALE_TEST_PARENT_PID": str(os.getpid()),
        }
        command = [sys.executable, "-m", "vescale.dtensor.testing._worker", str(child_end.fileno())]
        with open(output_file, "ab") as output:
            process = subprocess.Popen(
                [*command, output_file, stack_file],
                pass_fds=(child_end.fileno(),),
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        connection = Connection(os.dup(parent_end.fileno()))
        parent_end.close()
        child_end.close()
        return _RankProcess(process, connection, output_file, stack_file)

    def _collect(
        self, reference: FunctionRef, world_size: int, timeout_s: float, error_grace_s: float
    ) -> tuple[dict[int, RunReply], BaseException | None]:
        """Wait for the replies; return them with the error to raise, if any. Kills the pool
        where ranks are stuck or dead, keeps it where every rank replied."""
        started = time.monotonic()
        pending = {self._ranks[rank].connection: rank for rank in range(world_size)}
        replies: dict[int, RunReply] = {}
        crashes: dict[int, int | None] = {}
        first_failure: float | None = None
        while pending:
            limit = started + timeout_s if first_failure is None else first_failure + error_grace_s
            remaining = min(limit, started + timeout_s) - time.monotonic()
            if remaining <= 0:
                break
            # wait() returns some of the connections it was given.
            for connection in cast(list[Connection], wait(list(pending), timeout=remaining)):
                rank = pending.pop(connection)
                try:
                    replies[rank] = connection.recv()
                except (EOFError, OSError):
                    crashes[rank] = self._ranks[rank].exit_code()
                if (rank in crashes or not replies[rank].ok) and first_failure is None:
                    first_failure = time.monotonic()
        self._print_outputs(replies)
        stuck = sorted(pending.values())
        if first_failure is None and stuck:
            return replies, self._timeout_error(reference, world_size, timeout_s, stuck)
        if first_failure is None:
            return replies, None
        # The first rank to fail is the cause; peers of a failed rank often fail in turn
        # (gloo: "Connection reset by peer"). A crash has no timestamp and counts as first.
        failures = {rank: reply.failed_at for rank, reply in replies.items() if not reply.ok}
        failed = min(crashes) if crashes else min(failures, key=lambda rank: (failures[rank], rank))
        # A rank that failed to join its process group keeps half of one; it would hang the next run.
        if stuck or crashes or any(reply.in_setup for reply in replies.values() if not reply.ok):
            self.close(kill=True)
        return replies, self._failure_error(failed, world_size, replies, crashes, stuck)

    def _print_outputs(self, replies: dict[int, RunReply]) -> None:
        for rank in sorted(replies):
            if replies[rank].output:
                print(f"----- rank {rank} output -----\n{replies[rank].output}", end="", flush=True)

    def _timeout_error(
        self, reference: FunctionRef, world_size: int, timeout_s: float, stuck: list[int]
    ) -> RankTimeoutError:
        stacks = {rank: self._ranks[rank].dump_stacks() for rank in stuck}
        outputs = {rank: self._ranks[rank].read_output() for rank in stuck}
        self.close(kill=True)
        finished = sorted(set(range(world_size)) - set(stuck))
        report = "".join(
            f"\n----- rank {rank} stacks -----\n{stacks[rank]}"
            + (f"----- rank {rank} output -----\n{outputs[rank]}" if outputs[rank] else "")
            for rank in stuck
        )
        return RankTimeoutError(
            f"{reference.qualname} on {world_size} ranks timed out after {timeout_s:g} s: ranks {stuck} "
            f"had not returned (ranks {finished} had). Their processes were killed. A rank that waits "
            f"in a collective that another rank never entered hangs like this.{report}",
            stacks,
        )

    def _failure_error(
        self,
        failed: int,
        world_size: int,
        replies: dict[int, RunReply],
        crashes: dict[int, int | None],
        stuck: list[int],
    ) -> BaseException:
        others = sorted({*crashes, *(r for r, reply in replies.items() if not reply.ok)} - {failed})
        context = f"raised on rank {failed} of {world_size}"
        if others:
            context += f"; ranks {others} failed too"
        if stuck:
            context += f"; ranks {stuck} were still running and were killed"
        if failed in crashes:
            message = f"rank {failed} {_describe_exit(crashes[failed])} before replying ({context})"
            return RankCrashedError(message, failed, crashes[failed])
        reply = replies[failed]
        error: BaseException | None = None
        if reply.exception is not None:
            with contextlib.suppress(Exception):
                error = pickle.loads(reply.exception)
        if error is None:
            return RankFailedError(
                failed, reply.exception_type, reply.exception_message, reply.traceback_text
            )
        error.__cause__ = RemoteTraceback(failed, reply.traceback_text)
        if hasattr(error, "add_note"):
            error.add_note(f"[vescale.dtensor.testing] {context}")
        return error
