"""init_mesh on CPU registers, once per process, the exit handler that lets gloo workers finish.

The crash it prevents (a SIGABRT after the program ended, in about 1 run in 15 of the vescale
README example on 4 loaded CPU ranks) needs many runs to show; the closing note of issue #18
gives the stress counts. This checks the registration: one handler, whatever the number of
meshes, and that it releases the GIL for GLOO_EXIT_GRACE_S.
"""

from __future__ import annotations

import atexit
import time

from vescale.dtensor import gloo_exit
from vescale.dtensor.testing import run_on_ranks


def _callbacks_after_two_meshes() -> tuple[int, int, int, bool]:
    from vescale.dtensor import init_mesh

    before = atexit._ncallbacks()
    init_mesh(dp=2)
    after_first = atexit._ncallbacks()
    init_mesh(tp=2)
    return before, after_first, atexit._ncallbacks(), gloo_exit._registered


def test_a_cpu_mesh_registers_one_exit_handler():
    results = run_on_ranks(_callbacks_after_two_meshes, world_size=2)
    for before, after_first, after_second, registered in results:
        # The pool's worker may have registered it in an earlier test already: at most one more.
        assert registered
        assert after_first - before in (0, 1)
        assert after_second == after_first


def test_the_handler_releases_the_gil_for_the_grace_period():
    start = time.perf_counter()
    gloo_exit._grace()
    assert time.perf_counter() - start >= gloo_exit.GLOO_EXIT_GRACE_S
