"""The rank process: imports torch once, then runs one function per request until told to stop.

Started by :mod:`vescale.dtensor.testing._rank_pool` as
``python -m vescale.dtensor.testing._worker CONNECTION_FD OUTPUT_FILE STACK_FILE`` with its
stdout and stderr appending to OUTPUT_FILE, which it empties at the start of each run and
sends back with the reply. It dumps every thread's Python stack to STACK_FILE on SIGUSR1, which the
parent sends before killing a rank that overran its timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from vescale.dtensor.testing._global_state import isolated_run, reset_global_state
from vescale.dtensor.testing._protocol import READY, SHUTDOWN, RunReply, RunRequest
from vescale.dtensor.testing._rank_pool import mark_rank_process

OUTPUT_LIMIT_CHARS = 64_000


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the test process dies, so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _read_output(output_file: str) -> str:
    sys.stdout.flush()
    sys.stderr.flush()
    with open(output_file, encoding="utf-8", errors="replace") as output:
        text = output.read()
    if len(text) > OUTPUT_LIMIT_CHARS:
        text = f"[... {len(text) - OUTPUT_LIMIT_CHARS} characters cut ...]\n" + text[-OUTPUT_LIMIT_CHARS:]
    return text


def _failure_reply(rank: int, error: BaseException, started: float, *, in_setup: bool = False) -> RunReply:
    failed_at = time.time()  # before the process group goes down and peers fail in turn
    exception_bytes: bytes | None
    try:
        exception_bytes = pickle.dumps(error)
        pickle.loads(exception_bytes)
    except Exception:
        exception_bytes = None
    return RunReply(
        rank=rank,
        ok=False,
        exception=exception_bytes,
        exception_type=f"{type(error).__module__}.{type(error).__qualname__}",
        exception_message=str(error),
        traceback_text="".join(traceback.format_exception(type(error), error, error.__traceback__)),
        seconds=time.perf_counter() - started,
        failed_at=failed_at,
        in_setup=in_setup,
    )


def _live_threads() -> int:
    """The threads of this process, native ones included (gloo's), where the OS lists them."""
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/task"))
    return threading.active_count()


def _run(request: RunRequest) -> RunReply:
    started = time.perf_counter()
    rank_environment = {
        "RANK": str(request.rank),
        "LOCAL_RANK": str(request.rank),
        "WORLD_SIZE": str(request.world_size),
        "LOCAL_WORLD_SIZE": str(request.world_size),
    }
    with isolated_run(rank_environment):
        try:
            reset_global_state(request.seed)
            function = request.function.resolve()
            args, kwargs = pickle.loads(request.arguments)
            dist.init_process_group(
                request.backend,
                init_method=f"file://{request.store_path}",
                rank=request.rank,
                world_size=request.world_size,
                # Longer than the parent's timeout: the parent, not gloo, decides a rank is hung.
                timeout=timedelta(seconds=request.timeout_s + 60),
            )
            # gloo's full-mesh connect can finish on one rank before its peer: a rank that then
            # failed or returned at once tore down its sockets while the peer was still connecting
            # ("connectFullMesh failed ... Connection closed by peer"). Everyone connected first.
            dist.barrier()
        except BaseException as error:
            return _failure_reply(request.rank, error, started, in_setup=True)
        try:
            value_bytes = pickle.dumps(function(*args, **kwargs))
        except BaseException as error:
            return _failure_reply(request.rank, error, started)
        finally:
            dist.destroy_process_group()
    return RunReply(rank=request.rank, ok=True, value=value_bytes, seconds=time.perf_counter() - started)


def main(argv: list[str]) -> None:
    connection_fd, output_file, stack_file = int(argv[1]), argv[2], argv[3]
    _die_with_parent(int(os.environ["VESCALE_TEST_PARENT_PID"]))
    mark_rank_process()
    connection = Connection(connection_fd)
    stack_output = open(stack_file, "w")  # noqa: SIM115 - stays open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_output, all_threads=True)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    connection.send(READY)
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request == SHUTDOWN:
            return
        os.truncate(output_file, 0)
        reply = _run(request)
        connection.send(replace(reply, output=_read_output(output_file), threads=_live_threads()))


if __name__ == "__main__":
    main(sys.argv)
