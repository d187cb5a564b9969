"""The wrappers veScale installs into DTensor's redistribution planner, strategy selection and
sharding propagation: torch 2.11/2.12 backports of what 2.13 has, and, on every torch, guards that
keep data-parallel (batch) mesh dims Replicate.

Private PyTorch APIs: ``torch.distributed.tensor._redistribute`` (``_gen_transform_infos``,
``_gen_transform_infos_non_cached``, ``get_redistribute_planner``, ``_TransformInfo``),
``torch.distributed.tensor._sharding_prop`` (``_select_min_cost_strategy``, ``LocalLRUCache``),
the ``ShardingPropagator``'s ``propagate_op_sharding(_non_cached)`` and ``op_to_schema_info``, and
``DTensor._op_dispatcher._dispatch_get_local_results_slow_path``.

Importing this module (which importing ``vescale.dtensor._compat`` does) installs the torch 2.11
scalar-shape adjusters and the rewritten-op dispatch; the ``install_*`` functions are idempotent
and keep no state here (each wrapper carries its own marks).

Example::

    from vescale.dtensor._compat.patches import install_replicate_dims_guard
    install_replicate_dims_guard()
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from vescale.dtensor._compat.core import (
    PrivateTorchAPIError,
    _private_attribute,
    _private_class,
    torch_version,
)
from vescale.dtensor._compat.dispatcher import (
    _op_dispatcher,
    clear_dtensor_sharding_caches,
    dtensor_op_strategy,
    dtensor_sharding_propagator,
    dtensor_strategy_registries,
    dtensor_strategy_type,
)
from vescale.dtensor._compat.placements import strided_shard_type
from vescale.dtensor._placement_moves import (
    BATCH_MESH_DIMS,
    inner_local_shape,
    keeps_dims_replicate,
    leaves_a_batch_dim,
    moves_an_unchanged_replicate_dim,
    nested_strided_dims,
    one_dim_among_replicate_ones,
    through_replicate,
)

__all__ = [
    "BATCH_MESH_DIMS",
    "STRIDED_SHARD_UNDECODABLE_ERROR",
    "install_batch_dims_strategy_guard",
    "install_replicate_dims_guard",
    "install_strided_shard_greedy_redistribution",
    "register_dtensor_op_strategy_like",
    "replicate_batch_dims",
]


# --- torch 2.11 (the packages declare torch>=2.11) -----------------------------------------
# Two things veScale relies on arrived in DTensor after torch 2.11; on 2.11/2.12 they are
# added here, in the same private places 2.13 has them, and nothing changes on 2.13.
# * A DTensorSpec with a _StridedShard whose split factor is no product of mesh sizes (every
#   InterleavedShard) cannot be read as a shard order; 2.13's redistribution then plans the
#   move with its greedy planner, where 2.11 raises ValueError. The fallback wraps the private
#   module function that plans a redistribution (_redistribute._gen_transform_infos_non_cached,
#   called through its cached twin by every redistribution).
# * ShardingPropagator.op_to_scalar_shape_adjuster (rewrites an op's non-tensor arguments into
#   local ones): 2.11 has no such table. The propagator's uncached propagation is wrapped to
#   apply it as 2.13 does (after the strategy's decision, when an input is sharded), and its
#   per-thread LRU cache (ShardingPropagator.propagate_op_sharding) is rebuilt around the wrapper.

# The text of 2.11's ValueError for a _StridedShard that is no shard order (one source line of it).
STRIDED_SHARD_UNDECODABLE_ERROR = "is unable to be interpreted into a corresponding"
_REDISTRIBUTE_MODULE = "torch.distributed.tensor._redistribute"
_PLANNER_ATTRIBUTE = "_gen_transform_infos_non_cached"


def _redistribution_planner() -> tuple[Any, Any, Any, Any]:
    """DTensor's redistribution module, its uncached planner (what the wrappers below replace),
    the planner-object factory (for the greedy plan) and the cached planner (to clear)."""
    module = importlib.import_module(_REDISTRIBUTE_MODULE)
    plan = _private_attribute(_REDISTRIBUTE_MODULE, _PLANNER_ATTRIBUTE, None)
    get_planner = _private_attribute(_REDISTRIBUTE_MODULE, "get_redistribute_planner", None)
    cached_plan = _private_attribute(_REDISTRIBUTE_MODULE, "_gen_transform_infos", None)
    return module, plan, get_planner, cached_plan


def install_strided_shard_greedy_redistribution() -> None:
    """On torch 2.11/2.12, plan redistributions of undecodable ``_StridedShard`` greedily, as 2.13 does
    (idempotent; nothing on 2.13, where ``DTensorSpec`` raises a dedicated error that torch catches)."""
    if torch_version() >= (2, 13):
        return
    module, plan, get_planner, cached_plan = _redistribution_planner()
    if getattr(plan, "vescale_greedy_fallback", False):
        return

    def plan_with_greedy_fallback(src_spec: Any, dst_spec: Any, use_graph_based_transform: Any = None) -> Any:
        try:
            return plan(src_spec, dst_spec, use_graph_based_transform)
        except ValueError as error:
            if STRIDED_SHARD_UNDECODABLE_ERROR not in str(error):
                raise
            planner = get_planner(src_spec.device_mesh, src_spec.tensor_meta)
            greedy = planner.generate_greedy_transform_infos(src_spec, dst_spec)
            return through_replicate(greedy, strided_shard_type())

    plan_with_greedy_fallback.vescale_greedy_fallback = True  # type: ignore[attr-defined]
    keeps_replicate_dims = getattr(plan, "vescale_keeps_replicate_dims", False)
    plan_with_greedy_fallback.vescale_keeps_replicate_dims = keeps_replicate_dims  # type: ignore[attr-defined]
    setattr(module, _PLANNER_ATTRIBUTE, plan_with_greedy_fallback)
    cached_plan.cache_clear()  # plans that failed were not cached; ones that worked stay valid


# --- every torch: redistribution plans leave the data-parallel mesh dims alone -------------
# veScale's activations are Replicate over the dp (and ep) mesh dims while each rank holds its
# own part of the batch: the module is replicated there, the data is not. A plan that moves data
# across a mesh dim on which the tensor is Replicate before and after is a no-op for a truly
# replicated tensor but mixes two ranks' batches here. torch 2.13's graph-based planner, which
# plans every move that involves a _StridedShard, makes such plans: in the backward of OPT's
# flatten of a sequence-parallel [b, s, h] activation (Partial -> _StridedShard over tp, dp
# untouched) it strided-shards and all-gathers over dp in between, and dp2 x tp2 trained OPT
# with gradients 40% off. The wrapper keeps the planner's plan when it leaves those dims alone
# and otherwise takes the greedy plan, which moves each mesh dim that changes, on its own.


def install_replicate_dims_guard() -> None:
    """Plan every redistribution without moving data across a mesh dim on which the tensor is
    Replicate before and after (idempotent; see the comment above).

    Example::

        install_replicate_dims_guard()
        grad.redistribute(mesh, [Replicate(), _StridedShard(0, split_factor=2)])  # nothing over dp
    """
    module, plan, get_planner, cached_plan = _redistribution_planner()
    if getattr(plan, "vescale_keeps_replicate_dims", False):
        return

    def plan_keeping_replicate_dims(
        src_spec: Any, dst_spec: Any, use_graph_based_transform: Any = None
    ) -> Any:
        nested = _plan_around_nested_strided(src_spec, dst_spec, plan_keeping_replicate_dims)
        if nested is not None:
            return nested
        if not (one_dim_among_replicate_ones(src_spec, dst_spec) or leaves_a_batch_dim(src_spec, dst_spec)):
            transform_infos = plan(src_spec, dst_spec, use_graph_based_transform)
            if not moves_an_unchanged_replicate_dim(transform_infos, src_spec, dst_spec):
                return transform_infos
        planner = get_planner(src_spec.device_mesh, src_spec.tensor_meta)
        greedy = planner.generate_greedy_transform_infos(src_spec, dst_spec)
        return through_replicate(greedy, strided_shard_type()) if torch_version() < (2, 13) else greedy

    plan_keeping_replicate_dims.vescale_keeps_replicate_dims = True  # type: ignore[attr-defined]
    # The two wrappers may wrap each other in either order: each carries the other's mark.
    greedy_fallback = getattr(plan, "vescale_greedy_fallback", False)
    plan_keeping_replicate_dims.vescale_greedy_fallback = greedy_fallback  # type: ignore[attr-defined]
    setattr(module, _PLANNER_ATTRIBUTE, plan_keeping_replicate_dims)
    cached_plan.cache_clear()  # plans made before may move such dims


def _plan_around_nested_strided(src_spec: Any, dst_spec: Any, plan: Any) -> list[Any] | None:
    """The steps of a move from or to FSDP2's strided shard of an interleaved one (see
    ``_placement_moves.nested_strided_dims``), ``None`` for any other move: the outer mesh dim
    is gathered first (or split last) as the plain ``Shard`` of the inner rank's local tensor
    that it is, and ``plan`` moves the rest, which torch reads right."""
    strided = strided_shard_type()
    source, target = nested_strided_dims(src_spec, strided), nested_strided_dims(dst_spec, strided)
    if (source is None and target is None) or src_spec.placements == dst_spec.placements:
        return None
    transform_info = _private_class(_REDISTRIBUTE_MODULE, "_TransformInfo")
    spec_type = dtensor_strategy_type("dtensor_spec")

    def without(spec: Any, outer: int) -> Any:
        placements = list(spec.placements)
        placements[outer] = Replicate()
        return spec_type(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)

    if source is not None:
        outer, inner = source
        dim = src_spec.placements[outer].dim
        gather = transform_info(
            mesh_dim=outer,
            src_dst_placements=(Shard(dim), Replicate()),
            logical_shape=inner_local_shape(src_spec, inner),
        )
        return [gather, *plan(without(src_spec, outer), dst_spec)]
    assert target is not None
    outer, inner = target
    dim = dst_spec.placements[outer].dim
    split = transform_info(
        mesh_dim=outer,
        src_dst_placements=(Replicate(), Shard(dim)),
        logical_shape=inner_local_shape(dst_spec, inner),
    )
    return [*plan(src_spec, without(dst_spec, outer)), split]


# The same holds for the strategies sharding propagation chooses: with every input Replicate on
# a batch dim (dp, ep, pp), a strategy that shards over it (a free local chunk, so a zero-cost
# choice) splits two ranks' different batches as if they were one tensor. OLMo-2 under dp2 x tp2
# added (R, S(2)) + (R, Partial) into (S(0), S(2)), and its gradients came out 60% off. The
# wrapper keeps such dims Replicate in and out whenever a strategy allows it.
_SHARDING_PROP_MODULE = "torch.distributed.tensor._sharding_prop"
_SELECT_ATTRIBUTE = "_select_min_cost_strategy"


def replicate_batch_dims(op_schema: Any) -> list[int]:
    """The batch mesh dims on which every tensor argument of ``op_schema`` is Replicate: where the
    guard below keeps a strategy's inputs and outputs Replicate."""
    specs = list(op_schema.args_spec)
    names = specs[0].mesh.mesh_dim_names if specs else None
    return [
        dim
        for dim, name in enumerate(names or ())
        if name in BATCH_MESH_DIMS and all(spec.placements[dim].is_replicate() for spec in specs)
    ]


def install_batch_dims_strategy_guard() -> None:
    """Choose, for an op whose inputs are all Replicate on a batch mesh dim, only strategies that
    keep that dim Replicate (idempotent; see the comment above).

    Example::

        install_batch_dims_strategy_guard()
        hidden + attention_out     # (R, S(2)) + (R, P) stays Replicate over dp
    """
    module = importlib.import_module(_SHARDING_PROP_MODULE)
    select = _private_attribute(_SHARDING_PROP_MODULE, _SELECT_ATTRIBUTE, None)
    if getattr(select, "vescale_keeps_batch_dims", False):
        return

    def select_keeping_batch_dims(strategy: Any, op_schema: Any = None) -> Any:
        dims = replicate_batch_dims(op_schema) if op_schema is not None else []
        if dims and len(strategy.strategies) > 1:
            kept = [op_spec for op_spec in strategy.strategies if keeps_dims_replicate(op_spec, dims)]
            if kept and len(kept) < len(strategy.strategies):
                return select(type(strategy)(kept), op_schema)
        return select(strategy, op_schema)

    select_keeping_batch_dims.vescale_keeps_batch_dims = True  # type: ignore[attr-defined]
    setattr(module, _SELECT_ATTRIBUTE, select_keeping_batch_dims)
    clear_dtensor_sharding_caches()


def _install_scalar_shape_adjusters(propagator: Any) -> None:
    """Give a torch 2.11 ``ShardingPropagator`` 2.13's ``op_to_scalar_shape_adjuster`` table."""
    cache_class = _private_attribute("torch.distributed.tensor._sharding_prop", "LocalLRUCache", type)
    shard_types = (
        _private_attribute("torch.distributed.tensor.placement_types", "Shard", type),
        strided_shard_type(),
    )
    propagate = getattr(propagator, "propagate_op_sharding_non_cached", None)
    if propagate is None or not hasattr(propagator, "propagate_op_sharding"):
        raise PrivateTorchAPIError(
            "DTensor's ShardingPropagator.propagate_op_sharding(_non_cached) is missing in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )
    adjusters: dict[Any, Any] = {}

    def propagate_with_adjusters(op_schema: Any) -> Any:
        output_sharding = propagate(op_schema)
        adjust = adjusters.get(op_schema.op)
        if adjust is None:
            return output_sharding
        schema = output_sharding.redistribute_schema or op_schema
        input_specs = list(schema.args_spec)
        if any(isinstance(p, shard_types) for spec in input_specs for p in spec.placements):
            output_sharding.redistribute_schema = adjust(input_specs, schema)
            output_sharding.needs_redistribute = True
            output_sharding.use_val_from_redistribute_schema = True
        return output_sharding

    propagator.op_to_scalar_shape_adjuster = adjusters
    propagator.propagate_op_sharding_non_cached = propagate_with_adjusters
    propagator.propagate_op_sharding = cache_class(propagate_with_adjusters)


def _run_rewritten_ops() -> None:
    """Make a torch 2.11 dispatcher run the op of an adjusted schema (``split`` rewritten to
    ``split_with_sizes``), as 2.13 does. DTensor's C++ dispatch looks this method up on the
    dispatcher the first time an op needs it and keeps it, so this runs when this module is
    imported; stock 2.11 never rewrites an op, so the wrapper changes nothing else."""
    dispatcher = _op_dispatcher()
    local_results = getattr(dispatcher, "_dispatch_get_local_results_slow_path", None)
    if getattr(local_results, "vescale_runs_rewritten_ops", False):
        return
    if local_results is None:
        raise PrivateTorchAPIError(
            "DTensor._op_dispatcher._dispatch_get_local_results_slow_path is missing in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )

    def local_results_of_rewritten_op(op_call: Any, args: Any, op_info: Any) -> Any:
        output_sharding = op_info.output_sharding
        rewritten = output_sharding.redistribute_schema if output_sharding.needs_redistribute else None
        if rewritten is not None and rewritten.op != op_call:
            op_call = rewritten.op
        return local_results(op_call, args, op_info)

    local_results_of_rewritten_op.vescale_runs_rewritten_ops = True  # type: ignore[attr-defined]
    dispatcher._dispatch_get_local_results_slow_path = local_results_of_rewritten_op


def register_dtensor_op_strategy_like(op: Any, like: Any) -> None:
    """Give ``op`` the strategy (and runtime schema info) DTensor registered for ``like``; for ops
    torch 2.13 registers and 2.11 does not, e.g. ``detach_`` like ``detach``."""
    propagator = dtensor_sharding_propagator()
    dtensor_strategy_registries()["op_strategy_funcs"][op] = dtensor_op_strategy(like)
    schema_infos = getattr(propagator, "op_to_schema_info", None)
    if not isinstance(schema_infos, dict):
        raise PrivateTorchAPIError(
            f"DTensor's ShardingPropagator.op_to_schema_info is missing or not a dict in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )
    if like in schema_infos:
        schema_infos[op] = schema_infos[like]


# Installed when this module is imported: a propagation already under way when the table
# appeared would cache its decision unadjusted, and the C++ dispatch keeps the first local-results
# method it looks up.
if torch_version() < (2, 13):
    _install_scalar_shape_adjusters(dtensor_sharding_propagator())
    _run_rewritten_ops()
