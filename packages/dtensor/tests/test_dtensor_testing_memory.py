"""``PeakHeapInUse``: the peak of malloc's bytes in use in a block, over every thread.

Checked against allocations whose sizes and lifetimes are known (each held longer than the
millisecond sampling interval): the peak is the largest sum of tensors alive at once (not the
sum of everything allocated, nor the last tensor's size), what was alive before the block does
not count, and a tensor allocated on one thread and freed on another counts while it lives,
and not after (where the profiler's allocation records, kept per thread, lose such a free).
"""

from __future__ import annotations

import gc
import threading
import time

import torch

from vescale.dtensor.testing.memory import PeakHeapInUse, heap_in_use_bytes

MiB = 1 << 20
# Other small allocations and frees between the samples, either way: the frames and the sampler
# thread's objects, and in a pytest-xdist worker what earlier tests' threads free meanwhile (the
# peak measured 40 KiB under 5 MiB there once, with the garbage collector running).
SLACK = 256 * 1024


def _floats(mib: int) -> torch.Tensor:
    tensor = torch.ones(mib * MiB // 4)  # written: the same whether or not pages are touched
    time.sleep(0.02)
    return tensor


def test_the_peak_is_the_most_bytes_alive_at_once():
    gc.collect()
    before = _floats(8)  # alive before the block: not growth
    with PeakHeapInUse() as peak:
        first = _floats(2)
        second = _floats(3)  # 5 MiB alive
        del first
        third = _floats(1)  # 4 MiB alive
        del second, third
        fourth = _floats(4)  # 4 MiB alive
        del fourth
    assert abs(peak.growth - 5 * MiB) <= SLACK, peak.growth / MiB
    del before


def test_memory_freed_on_another_thread_stops_counting():
    gc.collect()
    start = heap_in_use_bytes()
    held: list[torch.Tensor] = []
    allocator = threading.Thread(target=lambda: held.append(torch.ones(8 * MiB // 4)))
    allocator.start()
    allocator.join()
    assert abs(heap_in_use_bytes() - start - 8 * MiB) <= SLACK
    releaser = threading.Thread(target=held.clear)
    releaser.start()
    releaser.join()
    assert abs(heap_in_use_bytes() - start) <= SLACK
