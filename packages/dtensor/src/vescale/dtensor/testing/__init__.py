"""Run a function on N gloo ranks on CPU: veScale's multi-process test harness.

Every package's tests use it. The rank processes are started once per test process and
reused (importing torch costs seconds, a run costs tens of milliseconds); each run gets a
new process group over a ``file://`` store (no ports), freshly seeded global state and a
timeout after which every rank is killed and the ranks' Python stacks are reported. A
rank's exception is re-raised in the caller as itself, noted with its rank and chained
to the rank's traceback.

Example::

    import torch, torch.distributed as dist
    from vescale.dtensor.testing import distributed_test

    @distributed_test(world_size=4)
    def test_all_reduce_sums_ranks():
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value)
        assert value.item() == 6.0

The function must be defined at module level (ranks look it up by module and name) and
its arguments and return value must pickle.
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from vescale.dtensor.testing import errors
from vescale.dtensor.testing._function_ref import RANK_BODY_ATTRIBUTE
from vescale.dtensor.testing._global_state import DEFAULT_SEED
from vescale.dtensor.testing._rank_pool import MAX_WORLD_SIZE, RankPool
from vescale.dtensor.testing.errors import *  # noqa: F403  (every harness error: errors.__all__)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_WORLD_SIZE",
    "RankPool",
    "distributed_test",
    "rank_pool",
    "run_on_ranks",
    "shutdown_rank_pool",
    *errors.__all__,
]

DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to finish or fail before they are taken
# for stuck (typically waiting in a collective that the failed rank never reached).
DEFAULT_ERROR_GRACE_S = 3.0

_TestFunction = TypeVar("_TestFunction", bound=Callable[..., Any])
_pool: RankPool | None = None


def rank_pool() -> RankPool:
    """The rank pool of this process, created on first use and closed at exit."""
    global _pool
    if _pool is None:
        _pool = RankPool()
        atexit.register(shutdown_rank_pool)
    return _pool


def shutdown_rank_pool() -> None:
    """Stop this process's rank processes; the next run starts new ones."""
    if _pool is not None:
        _pool.close()


def run_on_ranks(
    function: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    seed: int = DEFAULT_SEED,
    error_grace_s: float = DEFAULT_ERROR_GRACE_S,
) -> list[Any]:
    """Run ``function(*args, **kwargs)`` on ranks ``0..world_size-1``; return their results.

    Each rank starts with ``torch.distributed`` initialised (``backend``, ``world_size``),
    ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set, every generator seeded with ``seed``, float32
    defaults and one intra-op thread.

    Example::

        def rank_times_two():
            return 2 * torch.distributed.get_rank()

        assert run_on_ranks(rank_times_two, world_size=2) == [0, 2]
    """
    return rank_pool().run(
        function,
        world_size,
        args,
        kwargs,
        timeout_s=timeout_s,
        backend=backend,
        seed=seed,
        error_grace_s=error_grace_s,
    )


def distributed_test(
    world_size: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    seed: int = DEFAULT_SEED,
) -> Callable[[_TestFunction], _TestFunction]:
    """Decorate a module-level test so that its body runs on ``world_size`` ranks.

    pytest fixtures and ``parametrize`` arguments reach every rank (they must pickle).

    Example::

        @distributed_test(world_size=2)
        def test_broadcast(tmp_path):
            ...
    """

    def decorate(test_body: _TestFunction) -> _TestFunction:
        @functools.wraps(test_body)
        def run_test_on_ranks(*args: Any, **kwargs: Any) -> None:
            run_on_ranks(test_body, world_size, args, kwargs, timeout_s=timeout_s, backend=backend, seed=seed)

        setattr(run_test_on_ranks, RANK_BODY_ATTRIBUTE, test_body)
        return run_test_on_ranks  # type: ignore[return-value]

    return decorate
