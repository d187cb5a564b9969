"""``view`` and ``_unsafe_view`` that redistribute where PyTorch's strict view strategy refuses.

PyTorch marks its view strategies strict: when a view splits a sharded dim into parts that
do not divide by the mesh (a ``Shard(0)`` over 16 tokens viewed as ``(2, 8)`` on 4 ranks),
it raises "Cannot unflatten unevenly sharded tensor" (and, for a view that drops a sharded
size-1 dim, "would remove or reshape sharded dimension"), where its copying twin's strategy
(``view_copy``) redistributes that mesh dim to Replicate first. Autograd and
``transformers`` emit such views where a user cannot step in (the backward of
``x.view(-1, hidden)`` in an MoE block, ``_unsafe_view`` from a reshape), so for this one
failure the copying strategy is used; the result then no longer aliases the input.
Flattening an uneven shard into the dims after it keeps PyTorch's strict error.

torch 2.11 words its errors differently, has no ``view_copy`` strategy (``reshape``'s, with
the same dim map and no strictness, takes its place), and is stricter: it also refuses to
split a dim into sizes the mesh does not divide, to flatten dims after a sharded one (2.13
gives ``_StridedShard``), and to unflatten an interleaved-sharded dim into its parts (2.13
gives ``Shard`` of the part dim). The first two redistribute here as above; the last is
decided here without communication, as 2.13 does. The wrapper only runs when DTensor
propagates a new op schema (results are cached), so it costs nothing per call.

Example::

    import vescale.dtensor.ops  # installs the wrapper
    tokens = grad_tokens_shard0.view(2, 8, 32)   # 16 tokens on 4 ranks: gathered, then viewed
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from vescale.dtensor import _compat

__all__ = [
    "REDISTRIBUTING_VIEW_ERRORS",
    "UNEVEN_FLATTEN_ERROR",
    "VIEW_OPS_REDISTRIBUTING_ON_UNFLATTEN",
    "redistributing_on_unflatten",
]

aten = torch.ops.aten

# The starts of the errors PyTorch's strict view strategies raise where the copying strategy
# redistributes instead: an uneven unflatten, and a view that drops a sharded dim (a size-1
# dim sharded over the mesh: XLNet's batch of one, seq-first, under sequence parallelism)
# (2.13); a split into sizes the mesh does not divide, and a flatten of dims after a sharded
# one (2.11).
REDISTRIBUTING_VIEW_ERRORS = (
    "Cannot unflatten unevenly sharded tensor",
    "This operation would remove or reshape sharded dimension",
    "into multiple subdimensions",
    "Attempted to flatten multiple dimensions",
)
# The error both keep for flattening an uneven shard into the dims after it.
UNEVEN_FLATTEN_ERROR = (
    "Cannot flatten unevenly sharded tensor"
    if _compat.torch_version() >= (2, 13)
    else "Attempted to flatten unevenly sharded dimension"
)
VIEW_OPS_REDISTRIBUTING_ON_UNFLATTEN = (aten.view.default, aten._unsafe_view.default)
_STRIDED_SHARD = _compat.strided_shard_type()
# torch 2.11's strict view strategy reads _StridedShard as Shard where the split factor equals
# the leading size (an even 2-part unflatten): there the parts are decided first.
_STRICT_MISREADS_STRIDED_SHARD = _compat.torch_version() < (2, 13)


def _unflattened_parts(op_schema: Any) -> Any | None:
    """The strategy of a view that unflattens an interleaved-sharded dim into ``(parts, part)``:
    ``_StridedShard(d, k)`` becomes ``Shard(d + 1)`` with no communication; None otherwise."""
    input_strategy = op_schema.args_schema[0]
    if len(getattr(input_strategy, "strategies", ())) != 1:
        return None
    spec = input_strategy.strategies[0].output_spec
    in_shape = tuple(spec.shape)
    strided = [(mesh_dim, p) for mesh_dim, p in enumerate(spec.placements) if isinstance(p, _STRIDED_SHARD)]
    if len(strided) != 1:
        return None
    mesh_dim, placement = strided[0]
    dim, parts = placement.dim % len(in_shape), int(placement.split_factor)
    if in_shape[dim] % parts:
        return None
    unflattened = (*in_shape[:dim], parts, in_shape[dim] // parts, *in_shape[dim + 1 :])
    target = list(op_schema.args_schema[1])
    if target.count(-1) == 1:
        other_sizes = math.prod(size for size in target if size != -1)
        target[target.index(-1)] = math.prod(in_shape) // max(other_sizes, 1)
    if tuple(target) != unflattened:
        return None
    output_placements: list[Placement] = []
    for index, other in enumerate(spec.placements):
        if index == mesh_dim:
            output_placements.append(Shard(dim + 1))
        elif isinstance(other, Shard | _STRIDED_SHARD):
            if other.dim % len(in_shape) == dim:
                return None  # the dim is cut by another mesh dim too
            other_dim = other.dim % len(in_shape)
            shifted = other_dim + 1 if other_dim > dim else other_dim
            if isinstance(other, _STRIDED_SHARD):
                output_placements.append(_STRIDED_SHARD(shifted, split_factor=other.split_factor))
            else:
                output_placements.append(Shard(shifted))
        else:
            output_placements.append(other)
    output_spec = _compat.dtensor_strategy_type("dtensor_spec")(spec.mesh, tuple(output_placements))
    op_spec = _compat.dtensor_strategy_type("op_spec")(output_spec, (spec,), [[0.0]])
    return _compat.dtensor_strategy_type("op_strategy")([op_spec])


def _gathered_first(op_schema: Any) -> Any | None:
    """The view of the whole tensor, replicated, for a _StridedShard input no rule maps; else None."""
    input_strategy = op_schema.args_schema[0]
    if len(getattr(input_strategy, "strategies", ())) != 1:
        return None
    spec = input_strategy.strategies[0].output_spec
    if not any(isinstance(placement, _STRIDED_SHARD) for placement in spec.placements):
        return None
    spec_type = _compat.dtensor_strategy_type("dtensor_spec")
    replicate = tuple(Replicate() for _ in spec.placements)
    gathered = spec_type(spec.mesh, replicate, tensor_meta=spec.tensor_meta)
    op_spec = _compat.dtensor_strategy_type("op_spec")(spec_type(spec.mesh, replicate), (gathered,), [[1.0]])
    return _compat.dtensor_strategy_type("op_strategy")([op_spec])


def redistributing_on_unflatten(
    strict: Callable[[Any], Any], copying: Callable[[Any], Any]
) -> Callable[..., Any]:
    """A strategy function: ``strict``'s, or, where ``strict`` refuses with one of
    ``REDISTRIBUTING_VIEW_ERRORS``, the parts of an interleaved dim or ``copying``'s.

    Example::

        lenient = redistributing_on_unflatten(strict_view_strategy, view_copy_strategy)
        _compat.set_dtensor_op_strategy(torch.ops.aten.view.default, lenient)
    """

    def strategy(op_schema: Any) -> Any:
        if _STRICT_MISREADS_STRIDED_SHARD:
            parts = _unflattened_parts(op_schema)
            if parts is not None:
                return parts
        try:
            return strict(op_schema)
        except KeyError:
            # torch 2.13's strided-shard rewrite fails on a flatten that merges a
            # _StridedShard dim into the dim before it (Llama-4 under SP: KeyError: 1)
            replicated = _gathered_first(op_schema)
            if replicated is None:
                raise
            return replicated
        except RuntimeError as error:
            if not any(message in str(error) for message in REDISTRIBUTING_VIEW_ERRORS):
                raise
            parts = _unflattened_parts(op_schema)
            return copying(op_schema) if parts is None else parts

    strategy.vescale_strict_strategy = strict  # type: ignore[attr-defined]
    return strategy


def _install() -> None:
    strategies = _compat.dtensor_strategy_registries()["op_strategy_funcs"]
    # torch 2.11 registers no view_copy strategy; reshape's has the same dim map, unstrict.
    copying_op = aten.view_copy.default if aten.view_copy.default in strategies else aten.reshape.default
    copying = _compat.dtensor_op_strategy(copying_op)
    for view_op in VIEW_OPS_REDISTRIBUTING_ON_UNFLATTEN:
        registered = _compat.dtensor_op_strategy(view_op)
        # Idempotent: a re-imported module wraps PyTorch's strategy, not its own wrapper.
        strict = getattr(registered, "vescale_strict_strategy", registered)
        _compat.set_dtensor_op_strategy(view_op, redistributing_on_unflatten(strict, copying))


_install()
