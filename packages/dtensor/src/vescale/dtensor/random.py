"""Single-device random numbers on DTensors.

After :func:`manual_seed` with the same seed on every rank, a random op on a DTensor gives
bitwise the values that ``torch.manual_seed(seed)`` and the same call on the full tensor
give in one process, for every placement (Replicate, Shard, uneven shards,
InterleavedShard, Partial where meaningful) on any mesh, and leaves every rank's generator
in the state the single process's would be in, so the next random op matches too. Covered:
``torch.distributed.tensor.rand``/``randn`` with placements, the in-place fills
(``uniform_``, ``normal_``, ``bernoulli_``, ``exponential_``... and so every ``nn.init``
function built on them: ``kaiming_*``, ``xavier_*``, ``trunc_normal_``), ``F.dropout``
(``bernoulli_`` on CPU, ``native_dropout`` on CUDA), ``rand_like``/``randn_like``/
``randint_like``. A random op that cannot be made exact for a layout raises
:class:`RandomOpError` naming the op and the placements.

How and what it costs (details in :mod:`vescale.dtensor._random_strategy`). Every rank
replays the single process's generator:

* **CPU, shard = one contiguous run of the global elements** (Shard(0) and any
  leading-dim sharding): the rank discards the generator words before and after its run
  (int32 draws) and runs the op on its shard only. Exact because the CPU generator is an
  mt19937 word stream and the op draws a fixed number of words per element (``bernoulli_``
  and ``exponential_``: 2 per float, ``uniform_``: 1; ``normal_``: 1 per float in
  16-element blocks, so runs must be 16-aligned), which is measured once per op and dtype
  at first use rather than assumed. Discarding a word costs about as much as drawing one,
  so the saving is the op's own work on the other ranks' elements.
* Measured (``tools/bench/dtensor_ops.py``, 2-core AMD EPYC shared with other jobs, torch
  2.13, 4 ranks, dropout p=0.1 of a (4, 1024, 4096) float32 activation, ms per call):
  plain ``F.dropout`` of the local shard 50 (stock DTensor's cost, with wrong values),
  Shard(0) 253 (5.1x), Shard(2) 337 (6.8x), plain dropout of the full tensor 377 (7.6x).
* **everything else** (Shard on an inner dim, InterleavedShard, non-contiguous storage,
  CUDA, ops whose word use is not fixed): the rank runs the op on a tensor of the global
  shape and cuts its shard out: a global-size op per rank, plus an all-gather of the input
  for ops that read the input values (``native_dropout``, ``bernoulli`` of probabilities).
  On CUDA this is how exactness is kept: the Philox offsets are not used, and torch's own
  tracker (``OffsetBasedRNGTracker``) is replaced, since it gives shard values that differ
  from a single-device run.

Example::

    vescale.dtensor.random.manual_seed(0)          # on every rank
    weight = distribute_tensor(torch.empty(64, 32), mesh, [Shard(1)])
    torch.nn.init.kaiming_uniform_(weight)          # == the single-process init's values
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from vescale.dtensor import _compat
from vescale.dtensor._random_ops import register_random_ops
from vescale.dtensor._random_strategy import RandomCall, RandomOpError, draw_local

__all__ = ["RandomOpError", "SingleDeviceRNGTracker", "manual_seed", "use_single_device_random"]

_FACTORY_OPS = (torch.ops.aten.rand.default, torch.ops.aten.randn.default)


class SingleDeviceRNGTracker:
    """DTensor's RNG tracker while :func:`manual_seed` is in force: DTensor factories
    (``torch.distributed.tensor.rand``/``randn``) draw single-device values through it.

    Example::

        _compat.set_dtensor_rng_tracker(SingleDeviceRNGTracker())
        noise = torch.distributed.tensor.randn(8, 4, device_mesh=mesh, placements=[Shard(1)])
    """

    def __init__(self) -> None:
        # DTensor skips the tracker when this is False (e.g. torch's tracing helpers switch it).
        self.distribute_region_enabled = True

    @contextlib.contextmanager
    def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        if generator is not None:
            raise RandomOpError(
                f"a DTensor random op with placements {list(spec.placements)} passed its own generator "
                "through DTensor's RNG tracker; pass it to the op itself (vescale's handlers use it there)"
            )
        with _factory_mode_class()(spec):
            yield

    def _manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)


def _factory_handler(spec: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    call_kwargs = dict(kwargs)
    generator = call_kwargs.pop("generator", None)
    dtype = call_kwargs.get("dtype") or torch.get_default_dtype()
    device = call_kwargs.get("device") or torch.device("cpu")
    global_shape = tuple(spec.shape)
    call = RandomCall(func, "factory", (), call_kwargs, generator)
    local_template = torch.empty(list(args[0]), dtype=dtype, device=device)
    (local,) = draw_local(
        call,
        spec.mesh,
        spec.placements,
        global_shape,
        spec.stride,
        lambda: torch.empty(global_shape, dtype=dtype, device="meta"),
        local_template,
    )
    return local


@functools.cache
def _factory_mode_class() -> type:
    """A dispatch mode (its base class is private, hence built on first use) that replaces the
    local ``rand``/``randn`` call of a DTensor factory with the exact local shard."""

    if TYPE_CHECKING:
        from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
    else:
        _DispatchModeBase = _compat.torch_dispatch_mode_class()

    class FactoryShardMode(_DispatchModeBase):
        def __init__(self, spec: Any) -> None:
            super().__init__()
            self.spec = spec

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            if func in _FACTORY_OPS:
                return _factory_handler(self.spec, func, args, kwargs or {})
            return func(*args, **(kwargs or {}))

    return FactoryShardMode


def manual_seed(seed: int) -> None:
    """Seed every rank's generator and make random ops on DTensors give single-device values.

    Call it on every rank with the same seed (as ``torch.manual_seed`` in the single
    process); every random op after it, on DTensors or plain tensors, must run on every rank.

    Example::

        manual_seed(1234)
        dropped = torch.nn.functional.dropout(sharded_activation, p=0.1)
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise RandomOpError(f"manual_seed takes an int seed, the same on every rank; got {seed!r}")
    torch.manual_seed(seed)
    use_single_device_random()


def use_single_device_random() -> None:
    """Make random ops on DTensors give single-device values from now on (idempotent).

    :func:`manual_seed` calls it, and so does ``vescale.dmodule.parallelize_module``: a
    model's dropout on DTensors then draws what one device draws from the generator state
    every rank holds (``torch.manual_seed`` with the same seed on every rank). Without it,
    stock DTensor draws each rank's shard from the start of that rank's stream, which no
    single device draws.

    Example::

        torch.manual_seed(0)                 # on every rank
        use_single_device_random()
        dropped = torch.nn.functional.dropout(sharded_activation, p=0.1)
    """
    register_random_ops()
    if not isinstance(_compat.dtensor_rng_tracker(), SingleDeviceRNGTracker):
        _compat.set_dtensor_rng_tracker(SingleDeviceRNGTracker())
