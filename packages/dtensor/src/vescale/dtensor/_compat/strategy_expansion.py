"""Expand an op's single-mesh-dim strategies only over the mesh dims that can hold a choice.

DTensor (``torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy``) builds every
combination of an op's per-mesh-dim strategies: ``k ** mesh.ndim`` candidates, each with its
specs and redistribution costs, then keeps the cheapest. On veScale's meshes most dims are batch
dims (``dp``, ``ep``, ``pp``), where :func:`~vescale.dtensor._compat.install_batch_dims_strategy_guard`
already keeps every input and output Replicate whenever the inputs are: of an ``add`` with 11
single-dim strategies on a pp x dp x tp mesh, 1331 candidates are built and 11 can be chosen.
Measured on the 2-core CI class, the first step of a tiny Llama at pp2 x dp2 x tp2 spent 80 of its
115 s there.

:func:`install_batch_dims_expansion` builds only those candidates: it expands over the other dims
(a sub-mesh, inputs projected onto it, what torch's own function computes there), lifts each
candidate back with Replicate on the batch dims and prices it against the inputs on the whole mesh,
as torch would. The list is torch's full list less the candidates the guard discards, in torch's
order, with torch's costs, so the same strategy is chosen. It applies only where that holds:

* the expansion is for the op being propagated (not a foreach op's element, whose choice the guard
  does not see), with no tensor-list argument;
* a batch dim is Replicate in every tensor input (the guard's own test, over args and kwargs);
* one of the op's single-dim strategies is all Replicate; no ``_StridedShard`` input, no validity
  callback, no input on another mesh.

Otherwise, or when no candidate survives, torch's function runs unchanged. torch 2.13 only: the
function's signature on 2.11 and 2.12 was not checked, so they keep it as is.

Private PyTorch APIs: ``torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy`` and
``generate_redistribute_costs`` (and the ``_ops`` modules that imported the former by name),
``_op_schema.OpSchema``/``OpSpec``/``OpStrategy``, ``_dtensor_spec.DTensorSpec``, the
propagator's ``propagate_op_sharding(_non_cached)`` and ``_sharding_prop.LocalLRUCache``.

Example::

    from vescale.dtensor._compat.strategy_expansion import install_batch_dims_expansion
    install_batch_dims_expansion()   # idempotent; vescale.dtensor.ops installs it
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import Replicate

from vescale.dtensor._compat.core import (
    PrivateTorchAPIError,
    _private_attribute,
    _private_class,
    torch_version,
)
from vescale.dtensor._compat.dispatcher import clear_dtensor_sharding_caches, dtensor_sharding_propagator
from vescale.dtensor._compat.patches import replicate_batch_dims
from vescale.dtensor._compat.placements import strided_shard_type

__all__ = ["batch_dims_expansion_disabled", "install_batch_dims_expansion"]

_UTILS = "torch.distributed.tensor._ops.utils"
_EXPAND = "expand_to_full_mesh_op_strategy"
_OPS_PACKAGE = "torch.distributed.tensor._ops"
_DECOMPOSITIONS = "torch.distributed.tensor._decompositions"
# The keywords the reduced expansion passes on unchanged; any other one runs torch's function.
_PASSED_KEYWORDS = frozenset(
    {
        "output_tensor_meta",
        "input_index",
        "inplace_op",
        "allow_unbacked_sharding",
        "allow_uneven_sharding",
        "different_mesh_args",  # None only
    }
)

_state = threading.local()  # .propagating: the op schemas being propagated, innermost last; .off


@contextlib.contextmanager
def batch_dims_expansion_disabled() -> Iterator[None]:
    """Run torch's full expansion in this block (the tests compare both), caches cleared around it.

    Example::

        with batch_dims_expansion_disabled():
            out = a + b      # every candidate of every mesh dim, as stock DTensor builds them
    """
    clear_dtensor_sharding_caches()
    previous = getattr(_state, "off", False)
    _state.off = True
    try:
        yield
    finally:
        _state.off = previous
        clear_dtensor_sharding_caches()


def _has_tensor_list(op_schema: Any, spec_type: type) -> bool:
    values = [*op_schema.args_schema, *op_schema.kwargs_schema.values()]
    return any(
        isinstance(value, (list, tuple)) and any(isinstance(item, spec_type) for item in value)
        for value in values
    )


_submeshes: dict[tuple[int, tuple[str, ...]], tuple[Any, Any]] = {}


def _submesh(mesh: Any, names: tuple[str, ...]) -> Any:
    """``mesh[names]``, kept per mesh object (slicing builds no process group, but costs ~1 ms)."""
    key = (id(mesh), names)
    entry = _submeshes.get(key)
    if entry is not None and entry[0]() is mesh:
        return entry[1]
    submesh = mesh[names if len(names) > 1 else names[0]]
    _submeshes[key] = (weakref.ref(mesh, lambda _: _submeshes.pop(key, None)), submesh)
    return submesh


class _Types:
    """torch's private classes the expansion builds, read once."""

    def __init__(self) -> None:
        self.spec = _private_class("torch.distributed.tensor._dtensor_spec", "DTensorSpec")
        self.op_schema = _private_class("torch.distributed.tensor._op_schema", "OpSchema")
        self.op_spec = _private_class("torch.distributed.tensor._op_schema", "OpSpec")
        self.op_strategy = _private_class("torch.distributed.tensor._op_schema", "OpStrategy")
        self.costs = _private_attribute(_UTILS, "generate_redistribute_costs", None)
        self.strided = strided_shard_type()


def _reduced_expansion(
    types: _Types, expand: Any, mesh: Any, op_schema: Any, strategies: list[Any], keywords: dict[str, Any]
) -> Any:
    """Torch's candidates that keep the batch dims Replicate; ``None`` where that cannot be done exactly."""
    propagating = getattr(_state, "propagating", None)
    if getattr(_state, "off", False) or not propagating or mesh.ndim < 2:
        return None
    if keywords.get("different_mesh_args") is not None or not keywords.keys() <= _PASSED_KEYWORDS:
        return None
    top = propagating[-1]
    if op_schema.op is not top.op or _has_tensor_list(top, types.spec):
        return None
    inputs = [*op_schema.args_strategy, *op_schema.kwargs_strategy]
    top_specs = list(top.args_spec)
    if len(op_schema.args_strategy) != len(top_specs) or any(
        len(strategy.strategies) != 1 or strategy.strategies[0].output_spec is not spec
        for strategy, spec in zip(op_schema.args_strategy, top_specs, strict=False)
    ):
        return None
    if any(len(strategy.strategies) != 1 for strategy in inputs):
        return None
    batch = replicate_batch_dims(top)  # the guard's own rule
    input_specs = [strategy.strategies[0].output_spec for strategy in inputs]
    if not batch or len(batch) == mesh.ndim or any(spec.mesh != mesh for spec in input_specs):
        return None
    if any(isinstance(placement, types.strided) for spec in input_specs for placement in spec.placements):
        return None
    if any(not spec.placements[dim].is_replicate() for spec in input_specs for dim in batch):
        return None  # a kwarg sharded over a batch dim: the guard's test (args only) is not enough
    if not any(all(p is None or p.is_replicate() for p in entry) for entry in strategies):
        return None
    kept = [dim for dim in range(mesh.ndim) if dim not in batch]
    names = mesh.mesh_dim_names
    submesh = _submesh(mesh, tuple(names[dim] for dim in kept))

    def project(value: Any) -> Any:
        if not isinstance(value, types.op_strategy):
            return value
        strategy: Any = value
        spec = strategy.strategies[0].output_spec
        placements = tuple(spec.placements[dim] for dim in kept)
        return types.op_strategy(
            [types.op_spec(types.spec(submesh, placements, tensor_meta=spec.tensor_meta))]
        )

    projected = types.op_schema(
        op_schema.op,
        tuple(project(value) for value in op_schema.args_schema),
        {name: project(value) for name, value in op_schema.kwargs_schema.items()},
        schema_info=op_schema.schema_info,
    )
    candidates = expand(submesh, projected, strategies, **keywords).strategies
    if not candidates:
        return None

    def lift(spec: Any) -> Any:
        if spec is None:
            return None
        placements: list[Any] = [Replicate()] * mesh.ndim
        for position, dim in enumerate(kept):
            placements[dim] = spec.placements[position]
        return types.spec(mesh, tuple(placements), tensor_meta=spec.tensor_meta)

    lifted = []
    for candidate in candidates:
        outputs = candidate.output_specs
        output_specs = tuple(lift(spec) for spec in outputs) if isinstance(outputs, tuple) else lift(outputs)
        in_specs = [lift(spec) for spec in candidate.input_specs]
        costs = [types.costs(strategy, spec) for strategy, spec in zip(inputs, in_specs, strict=True)]
        lifted.append(types.op_spec(output_specs=output_specs, input_specs=in_specs, redistribute_cost=costs))
    return types.op_strategy(lifted)


def install_batch_dims_expansion() -> None:
    """Install the reduced expansion (idempotent; torch 2.13 and later; see the module docstring)."""
    if torch_version() < (2, 13):
        return
    utils = importlib.import_module(_UTILS)
    expand = _private_attribute(_UTILS, _EXPAND, None)
    if getattr(expand, "vescale_batch_dims_expansion", False):
        return
    types = _Types()

    def expand_keeping_batch_dims(mesh: Any, op_schema: Any, strategies: list[Any], **keywords: Any) -> Any:
        reduced = _reduced_expansion(types, expand, mesh, op_schema, strategies, keywords)
        return reduced if reduced is not None else expand(mesh, op_schema, strategies, **keywords)

    expand_keeping_batch_dims.vescale_batch_dims_expansion = True  # type: ignore[attr-defined]
    importlib.import_module(_DECOMPOSITIONS)
    for name, module in list(sys.modules.items()):
        ours = name in (_UTILS, _DECOMPOSITIONS) or name.startswith(_OPS_PACKAGE + ".")
        if ours and getattr(module, _EXPAND, None) is expand:
            setattr(module, _EXPAND, expand_keeping_batch_dims)
    setattr(utils, _EXPAND, expand_keeping_batch_dims)
    _track_propagated_ops(dtensor_sharding_propagator())
    clear_dtensor_sharding_caches()


def _track_propagated_ops(propagator: Any) -> None:
    """Have the propagator note the op schema it propagates (the reduced expansion checks it)."""
    cache_class = _private_attribute("torch.distributed.tensor._sharding_prop", "LocalLRUCache", type)
    propagate = getattr(propagator, "propagate_op_sharding_non_cached", None)
    if propagate is None or not hasattr(propagator, "propagate_op_sharding"):
        raise PrivateTorchAPIError(
            "DTensor's ShardingPropagator.propagate_op_sharding(_non_cached) is missing in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )

    def propagate_noting_the_op(op_schema: Any) -> Any:
        propagating = getattr(_state, "propagating", None)
        if propagating is None:
            propagating = _state.propagating = []
        propagating.append(op_schema)
        try:
            return propagate(op_schema)
        finally:
            propagating.pop()

    propagator.propagate_op_sharding_non_cached = propagate_noting_the_op
    propagator.propagate_op_sharding = cache_class(propagate_noting_the_op)
