"""The private PyTorch APIs that ``vescale.dtensor`` relies on, confined to this module.

PyTorch offers no public way to drop every global module hook or to forget DTensor's
random-number tracker, both of which the test harness must do between tests. Each access
below names the private attribute it reads, and ``tests/test_dtensor_compat.py`` fails
loudly when a PyTorch release renames or removes one.

Example::

    from vescale.dtensor import _compat
    _compat.clear_global_module_hooks()
"""

from __future__ import annotations

import functools
import importlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from vescale.dtensor._placement_moves import (
    BATCH_MESH_DIMS,
    keeps_dims_replicate,
    leaves_a_batch_dim,
    moves_an_unchanged_replicate_dim,
    one_dim_among_replicate_ones,
    through_replicate,
)

if TYPE_CHECKING:
    _ModeT = TypeVar("_ModeT", bound="TorchDispatchMode")

    class TorchDispatchMode:
        """For the type checker only: the part of ``torch.utils._python_dispatch.TorchDispatchMode``
        that vescale uses, annotated (torch leaves it unannotated). vescale's dispatch modes subclass
        it under ``TYPE_CHECKING`` and subclass ``torch_dispatch_mode_class()`` at run time."""

        def __init__(self) -> None: ...
        def __enter__(self: _ModeT) -> _ModeT: ...
        def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> None: ...
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any: ...

    from torch.distributed.tensor import Placement

    class StridedShard(Placement):
        """For the type checker only: what vescale reads of PyTorch's private ``_StridedShard``
        (the class strided_shard_type() returns at run time)."""

        dim: int
        split_factor: int

        def __init__(self, dim: int, *, split_factor: int) -> None: ...


__all__ = [
    "GLOBAL_MODULE_HOOK_DICTS",
    "MIN_TORCH",
    "TESTED_TORCH",
    "PrivateTorchAPIError",
    "clear_global_module_hooks",
    "dtensor_custom_op_handlers",
    "dtensor_random_ops",
    "dtensor_sharding_propagator",
    "reset_dtensor_rng_tracker",
    "torch_version",
    "unsupported_torch",
]

# The torch range for the private attributes of every package's _compat.py (doptim, dpipe
# import these): one range, since the packages are released in lockstep.
MIN_TORCH = (2, 11)
# The newest release these private attributes were checked against.
TESTED_TORCH = (2, 13)

# torch.nn.modules.module keeps every hook registered by register_module_forward_hook & co.
# in these module-level ordered dicts.
GLOBAL_MODULE_HOOK_DICTS = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


class PrivateTorchAPIError(RuntimeError):
    """A private PyTorch attribute that veScale relies on is missing or changed its type.

    Every package's ``_compat.py`` raises this one type (from :func:`unsupported_torch`), so a
    caller catches a changed PyTorch the same way whichever package noticed it.
    """


def unsupported_torch(problem: str, package: str = "vescale.dtensor") -> PrivateTorchAPIError:
    """The error for ``problem`` ("<private attribute> is missing") that ``package`` hits in this torch.

    It names the supported torch range and the ``_compat.py`` of ``package`` to update.

    Example::

        raise unsupported_torch("torch._subclasses.fake_tensor is missing", "vescale.dpipe")
    """
    return PrivateTorchAPIError(
        f"{problem} in torch {torch.__version__}; {package} was checked against torch "
        f"{MIN_TORCH[0]}.{MIN_TORCH[1]} to {TESTED_TORCH[0]}.{TESTED_TORCH[1]}. Install a torch in "
        f"that range, or update {package.replace('.', '/')}/_compat.py for this release."
    )


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor), e.g. ``(2, 13)``."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _private_attribute(module_name: str, attribute: str, expected_type: type | None) -> Any:
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise unsupported_torch(f"{module_name}.{attribute} does not exist")
    value = getattr(module, attribute)
    if expected_type is not None and not isinstance(value, expected_type):
        raise PrivateTorchAPIError(
            f"{module_name}.{attribute} is a {type(value).__name__} in torch {torch.__version__}, "
            f"expected {expected_type.__name__}; update vescale/dtensor/_compat.py for this release."
        )
    return value


def _private_class(module_name: str, attribute: str) -> type:
    found: type = _private_attribute(module_name, attribute, type)
    return found


def clear_global_module_hooks() -> None:
    """Remove every hook registered with ``torch.nn.modules.module.register_module_*_hook``."""
    for attribute in GLOBAL_MODULE_HOOK_DICTS:
        _private_attribute("torch.nn.modules.module", attribute, OrderedDict).clear()


# The hooks an nn.Module runs around its forward and backward: its own, and the global ones.
MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_CALL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def module_call_hooks(module: torch.nn.Module, *, include_global: bool = True) -> list[Any]:
    """Every hook that runs around a call of ``module``: its forward and backward (pre-)hooks,
    then (``include_global``) the global ones (``register_module_forward_hook`` & co.)."""
    hooks: list[Any] = []
    for attribute in MODULE_HOOK_DICTS:
        registered = getattr(module, attribute, None)
        if not isinstance(registered, dict):
            raise unsupported_torch(f"nn.Module.{attribute} is not a dict")
        hooks += registered.values()
    if include_global:
        hooks += global_call_hooks()
    return hooks


@functools.cache
def _global_call_hook_dicts() -> tuple[OrderedDict[Any, Any], ...]:
    # The same dict objects for the life of the process (torch clears them in place).
    return tuple(
        _private_attribute("torch.nn.modules.module", attribute, OrderedDict)
        for attribute in GLOBAL_CALL_HOOK_DICTS
    )


def global_call_hooks() -> list[Any]:
    """The hooks registered for every module's calls (``register_module_forward_hook`` & co.)."""
    hooks: list[Any] = []
    for registered in _global_call_hook_dicts():
        hooks += registered.values()
    return hooks


def global_call_hook_count() -> int:
    """``len(global_call_hooks())``, without building the list."""
    return sum(len(registered) for registered in _global_call_hook_dicts())


def module_call_hook_count(module: torch.nn.Module) -> int:
    """How many hooks of its own ``module`` runs around a call (cheap; see :func:`module_call_hooks`)."""
    return (
        len(module._forward_pre_hooks)
        + len(module._forward_hooks)
        + len(module._backward_pre_hooks)
        + len(module._backward_hooks)
    )


def reset_dtensor_rng_tracker() -> None:
    """Forget DTensor's random-number tracker so that the next random DTensor op makes a new one."""
    _private_attribute("torch.distributed.tensor._random", "_rng_tracker", None)
    random_module: Any = importlib.import_module("torch.distributed.tensor._random")
    random_module._rng_tracker = None


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
            "update vescale/dtensor/_compat.py for this release."
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
    # torch 2.11/2.12 have the table only as this module adds it (see its torch 2.11 section).
    adjusters = getattr(dtensor_sharding_propagator(), "op_to_scalar_shape_adjuster", None)
    if not isinstance(adjusters, dict):
        raise PrivateTorchAPIError(
            "DTensor's ShardingPropagator.op_to_scalar_shape_adjuster is missing or not a dict in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
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
            "update vescale/dtensor/_compat.py for this release."
        )
    cached()
    clear_fast_path()


__all__ += [
    "clear_dtensor_sharding_caches",
    "dtensor_scalar_shape_adjusters",
    "set_dtensor_custom_op_handlers",
]


# --- random numbers (vescale.dtensor.random) ----------------------------------------------
# DTensor's random factories (torch.distributed.tensor.rand/randn) draw their local shard
# inside ``_rng_tracker._distribute_region(spec)`` of the private module-level tracker; that
# tracker is the only hook on them. DTensor reads its ``distribute_region_enabled`` flag and
# calls ``_distribute_region(spec, generator=...)`` as a context manager.


def dtensor_rng_tracker() -> Any:
    """The RNG tracker DTensor's random ops and factories use now, or ``None``."""
    return _private_attribute("torch.distributed.tensor._random", "_rng_tracker", None)


def set_dtensor_rng_tracker(tracker: Any) -> None:
    """Make ``tracker`` DTensor's (it needs ``distribute_region_enabled`` and ``_distribute_region``)."""
    dtensor_rng_tracker()
    random_module: Any = importlib.import_module("torch.distributed.tensor._random")
    random_module._rng_tracker = tracker


__all__ += ["dtensor_rng_tracker", "set_dtensor_rng_tracker"]


# --- communication accounting (vescale.dtensor.comm) --------------------------------------
# Collectives run below autograd, where only a TorchDispatchMode sees them; torch keeps that
# class in a private module. Functional collectives name their process group by a string,
# and only a private resolver turns a name that belongs to no known mesh into its group.
# During backward, only a private query tells which autograd node is running.

FUNCTIONAL_COLLECTIVE_NAMESPACE = "_c10d_functional"
C10D_COLLECTIVE_NAMESPACE = "c10d"
# DTensor's own ops (``torch.ops._dtensor.shard_dim_alltoall``, the NCCL all-to-all).
DTENSOR_OP_NAMESPACE = "_dtensor"


def torch_dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base of vescale's dispatch modes."""
    return _private_class("torch.utils._python_dispatch", "TorchDispatchMode")


def resolve_process_group(group_name: str) -> Any:
    """The ``ProcessGroup`` registered under ``group_name`` (as functional collectives name it)."""
    resolve = _private_attribute("torch.distributed.distributed_c10d", "_resolve_process_group", None)
    return resolve(group_name)


def current_autograd_node() -> Any:
    """The autograd ``Node`` whose backward is running on this thread, or ``None`` outside backward."""
    return _private_attribute("torch._C", "_current_autograd_node", None)()


def custom_function_backward_class() -> type:
    """``BackwardCFunction``: the node class whose ``apply(*grads)`` runs a custom Function's backward."""
    return _private_class("torch.autograd.function", "BackwardCFunction")


# --- placements and redistribution (vescale.dtensor.placements, .redistribute) ------------
# InterleavedShard: a DTensor stores veScale's InterleavedShard(dim, k) as PyTorch's private
# _StridedShard(dim, split_factor=k), whose layout on one mesh dim (cut the dim into k parts,
# then torch.chunk each part over the mesh dim) is the same; DTensor accepts no other type.


def strided_shard_type() -> type[StridedShard]:
    """PyTorch's ``_StridedShard`` placement class, the form a DTensor stores an InterleavedShard in."""
    strided_shard: type[StridedShard] = _private_attribute(
        "torch.distributed.tensor.placement_types", "_StridedShard", type
    )
    if not isinstance(getattr(strided_shard, "split_factor", None), property):
        raise PrivateTorchAPIError(
            "torch.distributed.tensor.placement_types._StridedShard has no split_factor property in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
        )
    return strided_shard


# Shard(i) -> Shard(j): DTensor's redistribution calls the private method
# Shard._to_new_shard_dim(local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim),
# which on a CPU mesh all-gathers the tensor; vescale.dtensor.shard_alltoall swaps in an
# all-to-all. PyTorch's own version stays reachable for the meshes it keeps (non-CPU, and
# LocalTensorMode, PyTorch's single-process simulation of ranks).

SHARD_TO_NEW_SHARD_DIM_PARAMETERS = (
    "self",
    "local_tensor",
    "mesh",
    "mesh_dim",
    "current_logical_shape",
    "new_shard_dim",
)
_original_shard_to_new_shard_dim: Any = None


def original_shard_to_new_shard_dim() -> Any:
    """PyTorch's own ``Shard._to_new_shard_dim`` (as it was before any replacement)."""
    if _original_shard_to_new_shard_dim is not None:
        return _original_shard_to_new_shard_dim
    shard_class = _private_attribute("torch.distributed.tensor.placement_types", "Shard", type)
    method = getattr(shard_class, "_to_new_shard_dim", None)
    code = getattr(method, "__code__", None)
    parameters = code.co_varnames[: code.co_argcount] if code is not None else ()
    if parameters != SHARD_TO_NEW_SHARD_DIM_PARAMETERS:
        raise PrivateTorchAPIError(
            "torch.distributed.tensor.placement_types.Shard._to_new_shard_dim is missing or takes "
            f"{parameters} in torch {torch.__version__}, expected {SHARD_TO_NEW_SHARD_DIM_PARAMETERS}; "
            "update vescale/dtensor/_compat.py and vescale/dtensor/shard_alltoall.py for this release."
        )
    return method


def set_shard_to_new_shard_dim(replacement: Any) -> None:
    """Make ``Shard._to_new_shard_dim`` be ``replacement`` (idempotent; the original is kept)."""
    global _original_shard_to_new_shard_dim
    original = original_shard_to_new_shard_dim()
    _original_shard_to_new_shard_dim = original
    shard_class = _private_attribute("torch.distributed.tensor.placement_types", "Shard", type)
    shard_class._to_new_shard_dim = replacement


def local_tensor_mode_active() -> bool:
    """Whether PyTorch's ``LocalTensorMode`` (ranks simulated in one process) is active."""
    return _private_attribute("torch.distributed._local_tensor", "local_tensor_mode", None)() is not None


__all__ += [
    "SHARD_TO_NEW_SHARD_DIM_PARAMETERS",
    "local_tensor_mode_active",
    "original_shard_to_new_shard_dim",
    "set_shard_to_new_shard_dim",
]


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
                f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
            )
        registries[attribute] = registry
    return registries


def dtensor_implicit_replication_enabled() -> bool:
    """Whether DTensor currently treats plain tensors mixed with DTensors as Replicate."""
    dispatcher = _op_dispatcher()
    if not hasattr(type(dispatcher), "_allow_implicit_replication"):
        raise PrivateTorchAPIError(
            "DTensor._op_dispatcher._allow_implicit_replication is missing in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
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
            "update vescale/dtensor/_compat.py for this release."
        )
    return list(stack())


def pop_torch_function_mode() -> Any:
    """Take the innermost torch-function mode off this thread's stack and return it."""
    pop = _private_attribute("torch.overrides", "_pop_mode", None)
    if not callable(pop):
        raise PrivateTorchAPIError(
            f"torch.overrides._pop_mode is not callable in torch {torch.__version__}; "
            "update vescale/dtensor/_compat.py for this release."
        )
    return pop()


def push_torch_function_mode(mode: Any) -> None:
    """Put ``mode`` back as the innermost torch-function mode (after :func:`pop_torch_function_mode`)."""
    push = _private_attribute("torch.overrides", "_push_mode", None)
    if not callable(push):
        raise PrivateTorchAPIError(
            f"torch.overrides._push_mode is not callable in torch {torch.__version__}; "
            "update vescale/dtensor/_compat.py for this release."
        )
    push(mode)


def dtensor_op_strategy(op: Any) -> Any:
    """The strategy function DTensor registered for ``op`` (``OpSchema -> StrategyType``)."""
    strategies = dtensor_strategy_registries()["op_strategy_funcs"]
    if op not in strategies:
        raise PrivateTorchAPIError(
            f"DTensor has no strategy function for {op} in torch {torch.__version__}; "
            "update vescale/dtensor/_compat.py for this release."
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


__all__ += ["STRATEGY_TYPE_NAMES", "dtensor_strategy_type"]


def queue_autograd_engine_callback(callback: Any) -> None:
    """Run ``callback()`` when the backward pass now executing finishes (call during backward)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not hasattr(engine, "queue_callback"):
        raise PrivateTorchAPIError(
            "torch.autograd.Variable._execution_engine.queue_callback is missing in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
        )
    engine.queue_callback(callback)


__all__ += [
    "C10D_COLLECTIVE_NAMESPACE",
    "DTENSOR_OP_NAMESPACE",
    "FUNCTIONAL_COLLECTIVE_NAMESPACE",
    "active_torch_function_modes",
    "current_autograd_node",
    "custom_function_backward_class",
    "dtensor_implicit_replication_enabled",
    "dtensor_op_strategy",
    "dtensor_strategy_registries",
    "queue_autograd_engine_callback",
    "resolve_process_group",
    "set_dtensor_implicit_replication",
    "set_dtensor_op_strategy",
    "strided_shard_type",
    "torch_dispatch_mode_class",
]


# --- deferred initialisation (vescale.dtensor.deferred) -----------------------------------
# Deferred construction runs a module's constructor on fake tensors (meta storage, but they
# report the real device, so nn.init's `if tensor.is_meta: return` shortcuts are not taken)
# under a recording dispatch mode. FakeTensorMode, its data-dependent exceptions and the way
# to step outside every active dispatch mode (to draw real random numbers mid-recording)
# are private; so are an op's schema (which arguments it writes) and a storage's identity.


def fake_tensor_mode_class() -> type:
    """``torch._subclasses.fake_tensor.FakeTensorMode``: tensors with shapes but no data."""
    return _private_class("torch._subclasses.fake_tensor", "FakeTensorMode")


def fake_tensor_class() -> type[torch.Tensor]:
    """``torch._subclasses.fake_tensor.FakeTensor``, the tensor type FakeTensorMode creates."""
    fake_tensor: type[torch.Tensor] = _private_attribute("torch._subclasses.fake_tensor", "FakeTensor", type)
    return fake_tensor


def fake_tensor_data_dependent_errors() -> tuple[type[Exception], ...]:
    """The exceptions FakeTensorMode raises for ops whose result depends on tensor values."""
    return tuple(
        _private_attribute("torch._subclasses.fake_tensor", name, type)
        for name in ("DataDependentOutputException", "DynamicOutputShapeException")
    )


def disable_dispatch_modes() -> Any:
    """A context manager under which no TorchDispatchMode (fake or recording) is active."""
    return _private_attribute("torch.utils._python_dispatch", "_disable_current_modes", None)()


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode is active on this thread (fake tensors, selective
    activation checkpointing's op cache, a recording mode)."""
    stack = _private_attribute("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack", None)
    if not callable(stack):
        raise unsupported_torch(
            "torch.utils._python_dispatch._get_current_dispatch_mode_stack is not callable"
        )
    return bool(stack())


def op_schema(op: Any) -> Any:
    """The ``torch.FunctionSchema`` of an ``OpOverload`` (its arguments and their alias info)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not hasattr(schema, "arguments"):
        raise PrivateTorchAPIError(
            f"{op!r} has no _schema.arguments in torch {torch.__version__}; "
            "update vescale/dtensor/_compat.py for this release."
        )
    return schema


def storage_key(tensor: torch.Tensor) -> int:
    """An id of ``tensor``'s storage, equal for every view of it (valid while the storage lives)."""
    storage = tensor.untyped_storage()
    if not hasattr(storage, "_cdata"):
        raise PrivateTorchAPIError(
            f"torch.UntypedStorage has no _cdata in torch {torch.__version__}; "
            "update vescale/dtensor/_compat.py for this release."
        )
    key: int = storage._cdata
    return key


__all__ += [
    "disable_dispatch_modes",
    "fake_tensor_class",
    "fake_tensor_data_dependent_errors",
    "fake_tensor_mode_class",
    "op_schema",
    "storage_key",
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


# The same holds for the strategies sharding propagation chooses: with every input Replicate on
# a batch dim (dp, ep, pp), a strategy that shards over it (a free local chunk, so a zero-cost
# choice) splits two ranks' different batches as if they were one tensor. OLMo-2 under dp2 x tp2
# added (R, S(2)) + (R, Partial) into (S(0), S(2)), and its gradients came out 60% off. The
# wrapper keeps such dims Replicate in and out whenever a strategy allows it.
_SHARDING_PROP_MODULE = "torch.distributed.tensor._sharding_prop"
_SELECT_ATTRIBUTE = "_select_min_cost_strategy"


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
        specs = list(op_schema.args_spec) if op_schema is not None else []
        names = specs[0].mesh.mesh_dim_names if specs else None
        dims = [
            dim
            for dim, name in enumerate(names or ())
            if name in BATCH_MESH_DIMS and all(spec.placements[dim].is_replicate() for spec in specs)
        ]
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
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
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
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
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
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
        )
    if like in schema_infos:
        schema_infos[op] = schema_infos[like]


__all__ += [
    "BATCH_MESH_DIMS",
    "STRIDED_SHARD_UNDECODABLE_ERROR",
    "install_batch_dims_strategy_guard",
    "install_replicate_dims_guard",
    "install_strided_shard_greedy_redistribution",
    "register_dtensor_op_strategy_like",
]

# Installed when this module is imported: a propagation already under way when the table
# appeared would cache its decision unadjusted, and the C++ dispatch keeps the first local-results
# method it looks up.
if torch_version() < (2, 13):
    _install_scalar_shape_adjusters(dtensor_sharding_propagator())
    _run_rewritten_ops()
