"""Memory of the current process and its peak while a block runs: the resident set (Linux
``/proc``; :class:`PeakResident`) and the bytes malloc has handed out and not taken back
(glibc's ``mallinfo2``; :class:`PeakHeapInUse`).

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
import functools
import json
import resource
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = [
    "PeakHeapInUse",
    "PeakResident",
    "fix_mmap_threshold",
    "fresh_process_peak_growth",
    "heap_in_use_bytes",
    "high_water_mark_bytes",
    "release_free_heap",
    "reset_high_water_mark",
    "resident_bytes",
    "trimmed_resident_bytes",
    "warm_up_training",
]


def resident_bytes() -> int:
    """The current resident-set size of this process, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


@functools.cache
def _mallinfo2() -> Any:
    name = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(name), "mallinfo2", None) if name else None
    if function is None:
        raise RuntimeError(
            "heap_in_use_bytes needs glibc 2.33 or newer (mallinfo2); measure PeakResident here"
        )
    function.restype = _MallInfo2
    return function


def heap_in_use_bytes() -> int:
    """Bytes malloc has handed out and not taken back, over every thread's arena and its mmap'ed
    blocks (glibc's ``mallinfo2``: ``uordblks + hblkhd``). Unlike the resident set it does not
    count free pages malloc keeps, nor wait for pages to be touched.

    Example::

        before = heap_in_use_bytes(); weights = torch.empty(2**20); assert heap_in_use_bytes() > before
    """
    info = _mallinfo2()()
    return int(info.uordblks + info.hblkhd)


def release_free_heap() -> None:
    """Return malloc's free pages to the system (glibc ``malloc_trim``; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def trimmed_resident_bytes() -> int:
    """:func:`resident_bytes` after :func:`release_free_heap`: live memory, not malloc's free pages."""
    release_free_heap()
    return resident_bytes()


def high_water_mark_bytes() -> int:
    """The kernel's peak resident-set size of this process (``VmHWM``), in bytes: exact, no sampling.

    Example::

        reset_high_water_mark(); base = resident_bytes(); train(); growth = high_water_mark_bytes() - base
    """
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib * 1024


def reset_high_water_mark() -> None:
    """Restart the kernel's high-water mark from the current resident set (Linux ``clear_refs``),
    after handing malloc's free pages back so that they do not hold the mark up."""
    release_free_heap()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def fix_mmap_threshold(threshold_bytes: int = 128 * 1024) -> None:
    """Have glibc ``mmap`` every allocation from ``threshold_bytes`` up, and so unmap it on free.

    By default glibc raises its mmap threshold to the size of each large block freed (up to
    32 MiB), after which tensors of that size come from the heap and, once freed, stay in the
    resident set until a ``malloc_trim``: the resident set then measures glibc's caching, not
    the tensors alive. A fixed threshold keeps it following live tensor memory.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt"):
        m_mmap_threshold = -3  # glibc's malloc.h
        libc.mallopt(m_mmap_threshold, threshold_bytes)


def warm_up_training() -> None:
    """One AdamW step of a tiny ``transformers`` Llama (a test dependency), before a baseline is
    taken: the libraries' one-time set-up (thread pools, kernels' scratch, the optimizer's first
    step) then counts in the baseline, not as the measured run's memory.

    Example::

        warm_up_training(); base = trimmed_resident_bytes(); train(); growth = resident_bytes() - base
    """
    import torch
    from transformers import LlamaForCausalLM

    from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config

    model = LlamaForCausalLM(tiny_hf_config("llama"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters()).step()


class PeakResident:
    """The resident-set size at the start (``.start``) and its peak (``.peak``) in a ``with`` block.

    ``.growth`` is ``peak - start``: what the block needed on top of what was live before it.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.start = self.peak = 0

    @staticmethod
    def reading() -> int:
        """What is sampled: here the resident set."""
        return resident_bytes()

    @property
    def growth(self) -> int:
        """Bytes the reading grew by at its peak, over its value when the block began."""
        return self.peak - self.start

    def __enter__(self) -> PeakResident:
        release_free_heap()
        self.start = self.peak = self.reading()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.reading())
            time.sleep(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self.reading())


class PeakHeapInUse(PeakResident):
    """:class:`PeakResident` of :func:`heap_in_use_bytes`: the peak of the bytes malloc had handed
    out (torch's CPU tensors among them) in a ``with`` block, over every thread, sampled every
    millisecond (``.growth`` over the start, as there).

    Where the resident set also moves with what malloc keeps after a free and so with the order
    in which threads freed blocks (run to run, ±4 MiB on a 50 MiB peak here), this follows live
    allocations alone: the same build measured 26.40 and 26.41 MiB. Like any sampled peak it can
    miss an allocation that lives under a millisecond.

    Example::

        with PeakHeapInUse() as peak:
            model(batch).sum().backward()
        print(peak.growth / 2**20, "MiB")
    """

    @staticmethod
    def reading() -> int:
        """What is sampled: malloc's bytes in use."""
        return heap_in_use_bytes()


# The statement's own peak: the mark restarts just before it, from the resident set then.
_PEAK_GROWTH_SCRIPT = """
import json, sys
from vescale.dtensor.testing.memory import high_water_mark_bytes, reset_high_water_mark, resident_bytes
{setup}
reset_high_water_mark()
before = resident_bytes()
{statement}
print(json.dumps({{"growth_bytes": high_water_mark_bytes() - before}}))
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
