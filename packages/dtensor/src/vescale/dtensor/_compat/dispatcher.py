"""DTensor's op dispatcher and sharding propagator: per-op handlers, random ops, strategy
registries and types, cached sharding decisions, implicit replication, the torch-function mode
stack and the autograd engine's end-of-backward callbacks.

Private PyTorch APIs: ``DTensor._op_dispatcher`` (``_custom_op_handlers``, ``_random_ops``,
``sharding_propagator``, ``_allow_implicit_replication``), the ``ShardingPropagator``'s
registries (``op_strategy_funcs``, ``op_single_dim_strategy_funcs``, ``op_to_rules``,
``op_to_scalar_shape_adjuster``) and caches (``propagate_op_sharding.cache_clear``,
``torch._C._clear_DTensor_sharding_propagator_cache``), the strategy types of
``torch.distributed.tensor._op_schema`` and ``._dtensor_spec``, ``torch.overrides``'
``_get_current_function_mode_stack``/``_pop_mode``/``_push_mode`` and
``torch.autograd.Variable._execution_engine.queue_callback``.

The dispatcher, once found, is kept here (``_op_dispatcher``); nothing else holds it.

Example::

    from vescale.dtensor._compat.dispatcher import dtensor_op_strategy
    dtensor_op_strategy(torch.ops.aten.view.default)
"""

from __future__ import annotations

from typing import Any

import torch

from vescale.dtensor._compat.core import PrivateTorchAPIError, _private_attribute, _private_class

__all__ = [
    "STRATEGY_TYPE_NAMES",
    "active_torch_function_modes",
    "clear_dtensor_sharding_caches",
    "dtensor_custom_op_handlers",
    "dtensor_implicit_replication_enabled",
    "dtensor_op_strategy",
    "dtensor_random_ops",
    "dtensor_scalar_shape_adjusters",
    "dtensor_sharding_propagator",
    "dtensor_strategy_registries",
    "dtensor_strategy_type",
    "pop_torch_function_mode",
    "push_torch_function_mode",
    "queue_autograd_engine_callback",
    "set_dtensor_custom_op_handlers",
    "set_dtensor_implicit_replication",
    "set_dtensor_op_strategy",
]


# --- DTensor's op dispatcher -------------------------------------------------------------
# DTensor routes every aten op through one OpDispatcher. Three of its attributes are the
# only way to extend it beyond ``register_sharding``: per-op handlers that replace the
# sharding-propagation path, the set of ops treated as random, and the propagator that
# holds the registered strategies.


# DTensor creates its one OpDispatcher when its class is defined; handlers look it up per call.
_dispatcher: Any = None


def _op_dispatcher() -> Any:
    global _dispatcher
    if _dispatcher is not None:
        return _dispatcher
    dtensor_class = _private_attribute("torch.distributed.tensor", "DTensor", type)
    if not hasattr(dtensor_class, "_op_dispatcher"):
        raise PrivateTorchAPIError(
            f"torch.distributed.tensor.DTensor._op_dispatcher does not exist in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    _dispatcher = dtensor_class._op_dispatcher
    return _dispatcher


def dtensor_custom_op_handlers() -> dict[Any, Any]:
    """``{OpOverload: handler(op_call, args, kwargs)}`` that DTensor calls instead of propagating."""
    handlers = getattr(_op_dispatcher(), "_custom_op_handlers", None)
    if not isinstance(handlers, dict):
        raise PrivateTorchAPIError("DTensor._op_dispatcher._custom_op_handlers is missing or not a dict")
    return handlers


def dtensor_random_ops() -> set[Any]:
    """The set of ``OpOverload``s DTensor treats as random (drawn through its RNG tracker)."""
    random_ops = getattr(_op_dispatcher(), "_random_ops", None)
    if not isinstance(random_ops, set):
        raise PrivateTorchAPIError("DTensor._op_dispatcher._random_ops is missing or not a set")
    return random_ops


def dtensor_sharding_propagator() -> Any:
    """DTensor's ``ShardingPropagator`` (``op_strategy_funcs``, ``op_to_rules``, ``propagate``)."""
    propagator = getattr(_op_dispatcher(), "sharding_propagator", None)
    if propagator is None or not hasattr(propagator, "op_strategy_funcs"):
        raise PrivateTorchAPIError("DTensor._op_dispatcher.sharding_propagator is missing or changed")
    return propagator


# DTensor's C++ dispatch reads the handler table from the dispatcher on every call, so a
# dict subclass put in its place is honoured; torch's own code only calls dict methods on it.


def set_dtensor_custom_op_handlers(table: dict[Any, Any]) -> None:
    """Make ``table`` (a dict, possibly a subclass, holding every current entry) DTensor's handler table."""
    dtensor_custom_op_handlers()
    if not isinstance(table, dict):
        raise PrivateTorchAPIError(
            f"DTensor's custom op handler table must be a dict, got {type(table).__name__}"
        )
    _op_dispatcher()._custom_op_handlers = table


def dtensor_scalar_shape_adjusters() -> dict[Any, Any]:
    """``{OpOverload: adjust(input_specs, op_schema) -> op_schema}``: the propagator's rewrites of an
    op's non-tensor arguments into local values, applied when an input is sharded."""
    # torch 2.11/2.12 have the table only as _compat.patches adds it (see its torch 2.11 section).
    adjusters = getattr(dtensor_sharding_propagator(), "op_to_scalar_shape_adjuster", None)
    if not isinstance(adjusters, dict):
        raise PrivateTorchAPIError(
            "DTensor's ShardingPropagator.op_to_scalar_shape_adjuster is missing or not a dict in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )
    return adjusters


def clear_dtensor_sharding_caches() -> None:
    """Forget every cached sharding decision (Python's and the C++ fast path's), so that changed
    strategies apply to op schemas already seen."""
    cached = getattr(dtensor_sharding_propagator().propagate_op_sharding, "cache_clear", None)
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if cached is None or clear_fast_path is None:
        raise PrivateTorchAPIError(
            "DTensor's sharding caches (ShardingPropagator.propagate_op_sharding.cache_clear, "
            f"torch._C._clear_DTensor_sharding_propagator_cache) are missing in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    cached()
    clear_fast_path()


# --- operator coverage and implicit replication (vescale.dtensor.ops) ---------------------
# Coverage asks DTensor which ops it can shard: the propagator's three registries (strategy
# functions, single-mesh-dim strategies, legacy rules) plus the per-op custom handlers.
# Implicit replication is one flag behind a private property; torch's public context
# manager sets it to False on exit instead of restoring it, so scoped use cannot nest.
# The autograd engine's callback queue is the only way to act once a backward pass ends.


def dtensor_strategy_registries() -> dict[str, dict[Any, Any]]:
    """DTensor's per-op sharding registries by name; an op in any of them can be sharded."""
    propagator = dtensor_sharding_propagator()
    registries = {"custom_op_handlers": dtensor_custom_op_handlers()}
    for attribute in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"):
        registry = getattr(propagator, attribute, None)
        if not isinstance(registry, dict):
            raise PrivateTorchAPIError(
                f"DTensor's ShardingPropagator.{attribute} is missing or not a dict in torch "
                f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
            )
        registries[attribute] = registry
    return registries


def dtensor_implicit_replication_enabled() -> bool:
    """Whether DTensor currently treats plain tensors mixed with DTensors as Replicate."""
    dispatcher = _op_dispatcher()
    if not hasattr(type(dispatcher), "_allow_implicit_replication"):
        raise PrivateTorchAPIError(
            "DTensor._op_dispatcher._allow_implicit_replication is missing in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )
    return bool(dispatcher._allow_implicit_replication)


def set_dtensor_implicit_replication(enabled: bool) -> None:
    """Turn DTensor's implicit replication of plain tensors on or off (see the getter)."""
    dtensor_implicit_replication_enabled()
    _op_dispatcher()._allow_implicit_replication = enabled


# The autograd engine resets the thread's torch-function modes to those active when
# ``backward()`` started, so a scope cannot trust its own bookkeeping to know whether its mode
# is active (a block recomputed by activation checkpointing runs in backward); only torch's
# private mode stack tells.
def active_torch_function_modes() -> list[Any]:
    """The torch-function modes active on this thread now, outermost first."""
    stack = _private_attribute("torch.overrides", "_get_current_function_mode_stack", None)
    if not callable(stack):
        raise PrivateTorchAPIError(
            f"torch.overrides._get_current_function_mode_stack is not callable in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    return list(stack())


def pop_torch_function_mode() -> Any:
    """Take the innermost torch-function mode off this thread's stack and return it."""
    pop = _private_attribute("torch.overrides", "_pop_mode", None)
    if not callable(pop):
        raise PrivateTorchAPIError(
            f"torch.overrides._pop_mode is not callable in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    return pop()


def push_torch_function_mode(mode: Any) -> None:
    """Put ``mode`` back as the innermost torch-function mode (after :func:`pop_torch_function_mode`)."""
    push = _private_attribute("torch.overrides", "_push_mode", None)
    if not callable(push):
        raise PrivateTorchAPIError(
            f"torch.overrides._push_mode is not callable in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    push(mode)


def dtensor_op_strategy(op: Any) -> Any:
    """The strategy function DTensor registered for ``op`` (``OpSchema -> StrategyType``)."""
    strategies = dtensor_strategy_registries()["op_strategy_funcs"]
    if op not in strategies:
        raise PrivateTorchAPIError(
            f"DTensor has no strategy function for {op} in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    return strategies[op]


def set_dtensor_op_strategy(op: Any, strategy: Any) -> None:
    """Make ``strategy`` DTensor's strategy function for ``op``, keeping its schema info.

    DTensor's strategies for view ops raise where their copying twins redistribute; wrapping
    the registered function is the only way to change that without a per-call handler.
    """
    dtensor_op_strategy(op)
    dtensor_strategy_registries()["op_strategy_funcs"][op] = strategy


# A strategy function that decides placements itself (rather than through the public
# register_sharding, which expands one mesh dim's choices to every mesh dim) builds the
# propagator's private types: OpSchema, OpSpec, OpStrategy, TupleStrategy and DTensorSpec.
STRATEGY_TYPE_NAMES = {
    "op_schema": ("torch.distributed.tensor._op_schema", "OpSchema"),
    "op_spec": ("torch.distributed.tensor._op_schema", "OpSpec"),
    "op_strategy": ("torch.distributed.tensor._op_schema", "OpStrategy"),
    "tuple_strategy": ("torch.distributed.tensor._op_schema", "TupleStrategy"),
    "dtensor_spec": ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
}


def dtensor_strategy_type(name: str) -> type:
    """One of the propagator's types by its key in ``STRATEGY_TYPE_NAMES`` (e.g. ``"op_spec"``)."""
    module_name, attribute = STRATEGY_TYPE_NAMES[name]
    return _private_class(module_name, attribute)


def queue_autograd_engine_callback(callback: Any) -> None:
    """Run ``callback()`` when the backward pass now executing finishes (call during backward)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        raise PrivateTorchAPIError(
            "torch.autograd.Variable._execution_engine.queue_callback is missing in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat/ for this release."
        )
    engine.queue_callback(callback)
