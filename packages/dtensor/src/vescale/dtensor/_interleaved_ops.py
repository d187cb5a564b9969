"""Sharding strategies that split an interleaved-sharded tensor into its parts, and join parts
back, without communication, at no cost to any other split or cat.

A DTensor with ``_StridedShard(dim, split_factor=k)`` on one mesh dim (veScale's
``InterleavedShard(dim, k)``) holds ``part_0_r|part_1_r|...`` locally. PyTorch's strategy for
``split`` unshards the split dim (an all-gather); but when every split size is a whole number
of parts, each output is made of whole parts, and its local shard is a contiguous slice of
the local tensor: one part is an ordinary ``Shard(dim)``, ``g`` parts are
``_StridedShard(dim, g)``. ``cat`` of such pieces along ``dim`` (how autograd joins the
gradients of a ``split``) is the inverse, again local. ``chunk`` reaches DTensor as
``split``; ``view``/``unflatten`` into ``(k, part)`` already give ``Shard`` in PyTorch.

Why strategies. DTensor asks a strategy only the first time it meets an op schema (input
specs and non-tensor arguments), then serves the cached decision from its C++ fast path; a
per-op handler instead takes every call of the op, for every DTensor, through Python (2-4x
the dispatch time of a split). So each strategy here wraps the one registered before it and
hands it every schema it does not cover.

One thing a strategy cannot say: the local tensor holds ``part/m`` rows of each part, so the
split sizes must be rewritten into local ones. DTensor rewrites non-tensor arguments through
its per-op "scalar shape adjusters", but an op that has one runs every call on a sharded input
down the slow path; so the split strategy arms an adjuster for the one schema it decides, and
the adjuster takes itself out as soon as it has rewritten it. The rewrite is cached with the
decision. (Should another thread propagate a split in between, its schema is left as it is,
and only dispatched a little slower.)

Example::

    register_interleaved_ops()
    q, k, v = qkv.split(hidden_size, dim=-1)    # qkv: _StridedShard(-1, 3) -> three Shard(-1)
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Placement, Shard

from vescale.dtensor import _compat

__all__ = ["INTERLEAVED_OPS", "register_interleaved_ops", "restore_interleaved_ops"]

aten = torch.ops.aten
# Resolved once: the strategies below run on every new split/cat schema.
_STRIDED_SHARD = _compat.strided_shard_type()
_SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
# The attribute that marks an installed strategy and holds the one it wraps.
_WRAPPED_ATTRIBUTE = "vescale_interleaved_fallback"
_registered = False


def _parts_on(placement: Placement, dim: int, ndim: int) -> int | None:
    """How many whole parts of tensor dim ``dim`` a placement cuts: 1 for Shard, k for strided."""
    if isinstance(placement, _STRIDED_SHARD) and placement.dim % ndim == dim:
        return int(placement.split_factor)
    if isinstance(placement, Shard) and placement.dim % ndim == dim:
        return 1
    return None


def _sole_sharding(placements: Sequence[Placement], dim: int, ndim: int) -> tuple[int, int] | None:
    """``(mesh_dim, parts)`` when exactly one mesh dim shards tensor dim ``dim``, else None."""
    sharding = [
        (mesh_dim, parts)
        for mesh_dim, placement in enumerate(placements)
        if (parts := _parts_on(placement, dim, ndim)) is not None
    ]
    return sharding[0] if len(sharding) == 1 else None


def _with_parts(
    placements: Sequence[Placement], mesh_dim: int, dim: int, parts: int
) -> tuple[Placement, ...]:
    with_parts = list(placements)
    with_parts[mesh_dim] = Shard(dim) if parts == 1 else _STRIDED_SHARD(dim, split_factor=parts)
    return tuple(with_parts)


def _chunk_size(size: int, num_chunks: int, index: int) -> int:
    """The size of chunk ``index`` of ``torch.chunk`` over ``size`` rows (0 past the last chunk)."""
    chunk = -(-size // num_chunks)
    return max(0, min(chunk, size - index * chunk))


def _new_spec(like: Any, placements: tuple[Placement, ...]) -> Any:
    return _compat.dtensor_strategy_type("dtensor_spec")(like.mesh, placements)


# --- split: decide the parts, then rewrite the global split sizes into local ones ---------


@dataclass(frozen=True)
class _SplitRewrite:
    """The local ``split_with_sizes`` a split strategy decided for one input spec."""

    op: Any
    input_spec: Any
    local_sizes: tuple[int, ...]
    dim: int


class _PendingRewrite(threading.local):
    rewrite: _SplitRewrite | None = None


_pending = _PendingRewrite()
_armed_lock = threading.Lock()
_armed_threads = 0


def _arm(rewrite: _SplitRewrite) -> None:
    global _armed_threads
    adjusters = _compat.dtensor_scalar_shape_adjusters()
    with _armed_lock:
        if _pending.rewrite is None:
            _armed_threads += 1
        _pending.rewrite = rewrite
        adjusters[rewrite.op] = _rewrite_split_sizes


def _disarm() -> None:
    global _armed_threads
    adjusters = _compat.dtensor_scalar_shape_adjusters()
    with _armed_lock:
        _pending.rewrite = None
        _armed_threads -= 1
        if _armed_threads == 0:
            for op in _SPLIT_OPS:
                if adjusters.get(op) is _rewrite_split_sizes:
                    del adjusters[op]


def _rewrite_split_sizes(input_specs: list[Any], op_schema: Any) -> Any:
    rewrite = _pending.rewrite
    if rewrite is None:  # armed by another thread: not a schema this thread's strategy decided
        return op_schema
    _disarm()
    if rewrite.op is not op_schema.op or op_schema.args_schema[0] != rewrite.input_spec:
        return op_schema  # left over from a propagation that failed after the strategy ran
    schema_type = _compat.dtensor_strategy_type("op_schema")
    if rewrite.op is aten.split.Tensor and rewrite.local_sizes[0] > 0:
        # The same op with the local piece size: torch 2.11 can run only the op it was given.
        return schema_type(rewrite.op, (op_schema.args_schema[0], rewrite.local_sizes[0], rewrite.dim), {})
    # split_with_sizes: a rank that holds no rows of a part still needs every (empty) piece.
    local_arguments = (op_schema.args_schema[0], list(rewrite.local_sizes), rewrite.dim)
    return schema_type(aten.split_with_sizes.default, local_arguments, {})


def _split_sizes(split_size_or_sizes: Any, dim_size: int) -> list[int] | None:
    if not isinstance(split_size_or_sizes, int):
        return list(split_size_or_sizes)
    if split_size_or_sizes <= 0:
        return None
    return [min(split_size_or_sizes, dim_size - start) for start in range(0, dim_size, split_size_or_sizes)]


def _interleaved_split(op_schema: Any) -> tuple[Any, _SplitRewrite] | None:
    """The strategy and local rewrite of a split into whole parts of an interleaved dim, or None."""
    spec = op_schema.args_schema[0].strategies[0].output_spec
    ndim = len(spec.shape)
    coordinate = spec.mesh.get_coordinate()
    if ndim == 0 or coordinate is None:
        return None
    dim = (op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else 0) % ndim
    sharding = _sole_sharding(spec.placements, dim, ndim)
    dim_size = spec.shape[dim]
    if sharding is None or sharding[1] < 2 or dim_size % sharding[1]:
        return None
    mesh_dim, parts = sharding
    part_size = dim_size // parts
    sizes = _split_sizes(op_schema.args_schema[1], dim_size)
    if part_size == 0 or sizes is None or any(size % part_size for size in sizes):
        return None
    local_part_size = _chunk_size(part_size, spec.mesh.size(mesh_dim), coordinate[mesh_dim])
    output_specs = tuple(
        _new_spec(spec, _with_parts(spec.placements, mesh_dim, dim, size // part_size)) for size in sizes
    )
    op_spec = _compat.dtensor_strategy_type("op_spec")(output_specs, (spec,), [[0.0]])
    local_sizes = tuple(size // part_size * local_part_size for size in sizes)
    rewrite = _SplitRewrite(op_schema.op, spec, local_sizes, dim)
    return _compat.dtensor_strategy_type("op_strategy")([op_spec]), rewrite


@functools.cache
def _can_rewrite_split_arguments() -> bool:
    """Whether this torch has the adjuster table; without it a split into parts all-gathers, as
    stock PyTorch does, rather than fail."""
    try:
        _compat.dtensor_scalar_shape_adjusters()
    except _compat.PrivateTorchAPIError:
        return False
    return True


def _split_strategy(fallback: Callable[[Any], Any], op_schema: Any) -> Any:
    decided = _interleaved_split(op_schema) if _can_rewrite_split_arguments() else None
    if decided is None:
        return fallback(op_schema)
    strategy, rewrite = decided
    _arm(rewrite)
    return strategy


# --- cat: join whole parts of one size back into an interleaved tensor --------------------


def _interleaved_cat(op_schema: Any) -> Any | None:
    """The strategy of a cat of pieces that each hold whole parts of one size, or None."""
    children = getattr(op_schema.args_schema[0], "children", ())
    if not all(hasattr(child, "strategies") for child in children):
        return None
    specs = [child.strategies[0].output_spec for child in children]
    if len(specs) < 2:
        return None
    first = specs[0]
    if len(first.shape) == 0 or any(len(spec.shape) != len(first.shape) for spec in specs):
        return None
    ndim = len(first.shape)
    dim = (op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0) % ndim
    sole_shardings = [_sole_sharding(spec.placements, dim, ndim) for spec in specs]
    shardings = [sharding for sharding in sole_shardings if sharding is not None]
    if len(shardings) != len(sole_shardings) or len({mesh_dim for mesh_dim, _ in shardings}) != 1:
        return None
    mesh_dim = shardings[0][0]
    part_sizes = {divmod(spec.shape[dim], parts) for spec, (_, parts) in zip(specs, shardings, strict=True)}
    part_size, remainder = next(iter(part_sizes))
    joinable = (
        len(part_sizes) == 1
        and part_size >= 1
        and remainder == 0
        and len({_with_parts(spec.placements, mesh_dim, dim, 1) for spec in specs}) == 1
        and all(spec.mesh == first.mesh for spec in specs)
    )
    if not joinable:
        return None
    total_parts = sum(parts for _, parts in shardings)
    output_spec = _new_spec(first, _with_parts(first.placements, mesh_dim, dim, total_parts))
    op_spec = _compat.dtensor_strategy_type("op_spec")(output_spec, tuple(specs), [[0.0]] * len(specs))
    return _compat.dtensor_strategy_type("op_strategy")([op_spec])


def _cat_strategy(fallback: Callable[[Any], Any], op_schema: Any) -> Any:
    strategy = _interleaved_cat(op_schema)
    return fallback(op_schema) if strategy is None else strategy


INTERLEAVED_OPS: dict[Any, Callable[[Callable[[Any], Any], Any], Any]] = {
    aten.split.Tensor: _split_strategy,
    aten.split_with_sizes.default: _split_strategy,
    aten.cat.default: _cat_strategy,
}


def _wrapping(
    strategy: Callable[[Callable[[Any], Any], Any], Any], fallback: Callable[[Any], Any]
) -> Callable[..., Any]:
    def interleaved_aware_strategy(op_schema: Any) -> Any:
        return strategy(fallback, op_schema)

    setattr(interleaved_aware_strategy, _WRAPPED_ATTRIBUTE, fallback)
    return interleaved_aware_strategy


def register_interleaved_ops() -> None:
    """Wrap DTensor's split/cat strategies with the part-wise ones (idempotent).

    Example::

        register_interleaved_ops()
        parts = interleaved.chunk(3, dim=0)   # three Shard(0) DTensors, no all-gather
    """
    global _registered
    _registered = True
    wrapped_any = False
    for op, strategy in INTERLEAVED_OPS.items():
        registered = _compat.dtensor_op_strategy(op)
        if getattr(registered, _WRAPPED_ATTRIBUTE, None) is None:
            _compat.set_dtensor_op_strategy(op, _wrapping(strategy, registered))
            wrapped_any = True
    if wrapped_any:
        # torch 2.11 cannot plan a redistribution of a _StridedShard that is no shard order, nor
        # unflatten one into its parts without the view strategies of vescale.dtensor.ops.views.
        _compat.install_strided_shard_greedy_redistribution()
        if _compat.torch_version() < (2, 13):
            importlib.import_module("vescale.dtensor.ops.views")
        # Decisions cached before (an all-gather for an interleaved split) must be made again.
        _compat.clear_dtensor_sharding_caches()


def restore_interleaved_ops() -> None:
    """Wrap again a split/cat strategy registered over ours, once interleaved sharding is in use.

    Example::

        register_sharding(aten.cat.default)(cat_strategy)   # replaces the wrapped strategy
        restore_interleaved_ops()
    """
    if _registered:
        register_interleaved_ops()
