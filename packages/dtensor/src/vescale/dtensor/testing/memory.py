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
import json
import resource
import subprocess
import sys
import threading
import time

__all__ = ["PeakResident", "fresh_process_peak_growth", "release_free_heap", "resident_bytes"]


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


# Writing 5 to clear_refs resets the kernel's peak-RSS mark (VmHWM) to the current RSS, so the
# peak read after the statement is the statement's own, to the page, with no sampling.
_PEAK_GROWTH_SCRIPT = """
import json, sys
{setup}

def status_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))

with open("/proc/self/clear_refs", "w") as clear_refs:
    clear_refs.write("5")
before = status_kib("VmRSS:")
{statement}
print(json.dumps({{"growth_bytes": (status_kib("VmHWM:") - before) * 1024}}))
"""


def fresh_process_peak_growth(setup: str, statement: str, *argv: str, timeout_s: float = 300.0) -> int:
    """Bytes a fresh Python process's resident set grows by at its peak while the one-line
    ``statement`` runs, after ``setup`` (imports); ``argv`` is the process's ``sys.argv[1:]``.
    Raises ``subprocess.CalledProcessError`` (with its stderr) when the process fails. Linux only.

    Example::

        growth = fresh_process_peak_growth(
            "from vescale.dcheckpoint import export_hf", "export_hf(sys.argv[1], sys.argv[2])", src, out
        )
    """
    script = _PEAK_GROWTH_SCRIPT.format(setup=setup, statement=statement)
    measured = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    growth: int = json.loads(measured.stdout.strip().splitlines()[-1])["growth_bytes"]
    return growth
