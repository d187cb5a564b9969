"""Let gloo's worker threads let go of their last collectives before the interpreter finalizes.

A gloo process group runs each collective on a worker thread, which drops its reference to
the finished work (and to the tensors the work holds) a moment after the caller's ``wait()``
returns. When that moment falls after the interpreter has begun to finalize, dropping a
tensor that Python created needs the GIL, the thread is told to exit instead, and the
process aborts (``terminate called without an active exception``, SIGABRT) after the
program has finished: seen in about 1 run in 15 of the vescale README example on 4 CPU
ranks under load, at the last ZeRO parameter all-gather (core dump: the gloo worker in
``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``).
PyTorch does not wait for these threads (pytorch/pytorch#179291 proposed it and was
abandoned). Exit handlers still run with the interpreter whole, so one that releases the GIL
for a moment lets the workers finish first; :func:`init_mesh` registers it for CPU meshes.

Example::

    wait_for_gloo_workers_at_exit()   # once per process; later calls do nothing
"""

from __future__ import annotations

import atexit
import time

__all__ = ["GLOO_EXIT_GRACE_S", "wait_for_gloo_workers_at_exit"]

# Seconds the exit handler releases the GIL for: a worker needs only to be scheduled once.
GLOO_EXIT_GRACE_S = 0.2
_registered = False


def _grace() -> None:
    time.sleep(GLOO_EXIT_GRACE_S)


def wait_for_gloo_workers_at_exit() -> None:
    """Register (once) an exit handler that gives gloo's worker threads a moment to finish.

    Example::

        wait_for_gloo_workers_at_exit()
    """
    global _registered
    if not _registered:
        atexit.register(_grace)
        _registered = True
