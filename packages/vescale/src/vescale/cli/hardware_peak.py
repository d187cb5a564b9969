"""The peak FLOP/s that MFU divides by: the planner's hardware profile of the device.

A GPU's peak is the built-in profile of :mod:`vescale.planner.hardware` whose name and memory
match the device (``h100-80gb``, ``h200-141gb``, ``a100-80gb``, ``a100-40gb``), at the dtype the
model trains in. A CPU rank's peak is the ``cpu`` profile that :func:`~vescale.planner.hardware.calibrate_cpu`
measures (float32 matmuls on ``nproc`` ranks at once, one thread each, as ``vescale plan
--calibrate`` does), times the rank's threads. The launcher calibrates once per machine, rank
count and torch version and keeps the profile in the user's cache directory
(``$XDG_CACHE_HOME/vescale/hardware``, else ``~/.cache/vescale/hardware``); delete the file to
measure again. A device without a profile has no MFU.

Example::

    per_rank, source = calibrated_cpu_peak(nproc=4)          # in the launcher, before the ranks
    peak = rank_peak_flops(torch.device("cpu"), per_rank, torch.float32)   # in a rank
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch

__all__ = ["calibrated_cpu_peak", "cpu_profile_cache", "rank_peak_flops"]

# The rank harness that calibrates runs at most this many ranks at once.
_MAX_CALIBRATION_RANKS = 8


def cpu_profile_cache(nproc: int) -> Path:
    """Where the calibrated ``cpu`` profile of this machine for ``nproc`` ranks is kept.

    Example::

        cpu_profile_cache(4)   # ~/.cache/vescale/hardware/cpu-<host>-2cpus-4ranks-torch2.13.0.json
    """
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = f"cpu-{socket.gethostname()}-{os.cpu_count()}cpus-{nproc}ranks-torch{torch.__version__}.json"
    return root / "vescale" / "hardware" / name


def calibrated_cpu_peak(nproc: int) -> tuple[float, str]:
    """The float32 FLOP/s of one CPU rank with one thread, from the calibrated ``cpu`` profile.

    Measured with ``calibrate_cpu(nproc)`` the first time (a few seconds), read from
    :func:`cpu_profile_cache` after. Returns the peak and a description of where it comes from.

    Example::

        peak, source = calibrated_cpu_peak(4)
    """
    from vescale.planner import PlanError
    from vescale.planner.hardware import HardwareProfile, calibrate_cpu

    cache = cpu_profile_cache(nproc)
    profile = None
    if cache.is_file():
        try:
            profile = HardwareProfile.from_dict(json.loads(cache.read_text()))
        except (OSError, ValueError, TypeError, PlanError):
            profile = None  # damaged or from another version: measure again
    if profile is None:
        print(f"calibrating the cpu hardware profile on {nproc} ranks for MFU (once; kept in {cache})...")
        profile = calibrate_cpu(min(nproc, _MAX_CALIBRATION_RANKS))
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f".{cache.name}.{os.getpid()}")
        partial.write_text(json.dumps(profile.to_dict(), indent=2))
        partial.replace(cache)
    return profile.peak_flops("fp32"), f"the planner's calibrated cpu profile ({cache})"


def _gpu_profile_peak(device: torch.device, dtype: torch.dtype) -> float | None:
    from vescale.planner.hardware import BUILTIN_PROFILES

    name = torch.cuda.get_device_name(device).lower()
    memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    matches = [
        profile
        for key, profile in BUILTIN_PROFILES.items()
        if key.split("-")[0] in name and abs(profile.memory_gb - memory_gb) / profile.memory_gb < 0.2
    ]
    return matches[0].peak_flops(dtype) if len(matches) == 1 else None


def rank_peak_flops(
    device: torch.device, cpu_peak_per_thread: float | None, dtype: torch.dtype
) -> float | None:
    """The peak FLOP/s of this rank's device (``None``: no profile, no MFU).

    ``cpu_peak_per_thread``: the launcher's :func:`calibrated_cpu_peak`, scaled here by this
    rank's intra-op threads.

    Example::

        rank_peak_flops(torch.device("cpu"), 2.5e10, torch.float32)   # 2.5e10 x threads
    """
    if device.type == "cuda":
        return _gpu_profile_peak(device, dtype)
    if device.type == "cpu" and cpu_peak_per_thread:
        return cpu_peak_per_thread * torch.get_num_threads()
    return None
