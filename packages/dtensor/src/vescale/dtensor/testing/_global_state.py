"""Process-wide state that one test run on a rank must not leak into the next.

Rank processes are reused across tests, so before each run they are put back into the
state of a fresh process: seeded generators, float32 default dtype, CPU default device,
autograd on, one intra-op thread, no global module hooks, no DTensor RNG tracker, no
compiled-graph caches; and after each run the environment variables and working
directory are restored.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vescale.dtensor import _compat

__all__ = ["DEFAULT_SEED", "isolated_run", "reset_global_state"]

DEFAULT_SEED = 0


def reset_global_state(seed: int = DEFAULT_SEED) -> None:
    """Return torch, random and numpy to what a freshly started, seeded process has."""
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    if torch.are_deterministic_algorithms_enabled():  # switching it costs ~2 s on first call
        torch.use_deterministic_algorithms(False)
    torch.set_num_threads(1)
    _compat.clear_global_module_hooks()
    if "torch.distributed.tensor._random" in sys.modules:  # no DTensor yet, no tracker to forget
        _compat.reset_dtensor_rng_tracker()
    if "torch.distributed.tensor" in sys.modules:
        # Cached sharding decisions hold the meshes of earlier runs; a new mesh of the same shape
        # compares equal, so a cached output spec would name a destroyed process group.
        _compat.clear_dtensor_sharding_caches()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


@contextmanager
def isolated_run(extra_environment: dict[str, str]) -> Iterator[None]:
    """Run with ``extra_environment`` set; afterwards restore ``os.environ`` and the cwd."""
    saved_environment = dict(os.environ)
    saved_cwd = os.getcwd()
    os.environ.update(extra_environment)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environment)
