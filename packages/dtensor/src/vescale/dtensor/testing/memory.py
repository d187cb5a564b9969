"""Resident memory of the current process, and its peak while a block runs (Linux ``/proc``).

Benchmarks report memory as deltas over a baseline taken after imports and set-up, so that
the interpreter, torch and the test harness do not count. Large CPU tensors are ``mmap``-ed
by the allocator and returned on free, so the resident set follows live tensor memory; the
peak is sampled every millisecond by a background thread (tensors alive for less than that
can be missed, which only makes a peak look smaller).

Example::

    baseline = resident_bytes()
    with PeakResident() as peak:
        model(batch).sum().backward()
    print((peak.peak - baseline) / 2**20, "MiB")
"""

from __future__ import annotations

import resource
import threading
import time

__all__ = ["PeakResident", "resident_bytes"]


def resident_bytes() -> int:
    """The current resident-set size of this process, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


class PeakResident:
    """The largest resident-set size (``.peak``, bytes) seen while the ``with`` block runs."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = 0

    def __enter__(self) -> PeakResident:
        self.peak = resident_bytes()
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
