"""Resident memory of the current process, and its peak while a block runs (Linux ``/proc``).

Benchmarks report memory as deltas over a baseline taken after imports and set-up, so that
the interpreter, torch and the test harness do not count. Large CPU tensors are ``mmap``-ed
by the allocator and returned on free; smaller ones come from malloc's arenas, whose free
pages :class:`PeakResident` hands back to the system first (glibc's ``malloc_trim``), so that
reusing them shows as growth too. The resident set then follows live tensor memory; the peak
is sampled every millisecond by a background thread (tensors alive for less than that can be
missed, which only makes a peak look smaller).

Example::

    with PeakResident() as peak:
        model(batch).sum().backward()
    print(peak.growth / 2**20, "MiB")
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import threading
import time

__all__ = ["PeakResident", "release_free_heap", "resident_bytes"]


def resident_bytes() -> int:
    """The current resident-set size of this process, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def release_free_heap() -> None:
    """Return malloc's free pages to the system (glibc ``malloc_trim``; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class PeakResident:
    """The resident-set size at the start (``.start``) and its peak (``.peak``) in a ``with`` block.

    ``.growth`` is ``peak - start``: what the block needed on top of what was live before it.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.start = self.peak = 0

    @property
    def growth(self) -> int:
        """Bytes the resident set grew by at its peak, over its size when the block began."""
        return self.peak - self.start

    def __enter__(self) -> PeakResident:
        release_free_heap()
        self.start = self.peak = resident_bytes()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())
