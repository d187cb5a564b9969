"""Fault injection for crash-safety tests: a function that kills its own process mid-run.

A test patches one step of the code under test (a write, an fsync, a rename) with
:func:`kill_on_call`, runs it in a forked child or a subprocess, and checks what the
SIGKILL left behind, as a machine that loses power or a launcher that tears down a job would.

Example::

    os.rename = kill_on_call(1, os.rename)   # in the child: die just before the first rename
    save(directory, state)                  # never returns
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

__all__ = ["kill_on_call"]


def kill_on_call(call_number: int, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, except that its ``call_number``-th call (from 1) SIGKILLs this process first.

    Example::

        writer.write_piece = kill_on_call(2, writer.write_piece)   # the second piece is never written
    """
    calls = 0

    def patched(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == call_number:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    return patched
