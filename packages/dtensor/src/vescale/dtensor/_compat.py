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

import importlib
from collections import OrderedDict
from typing import Any

import torch

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
]

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
    """A private PyTorch attribute that veScale relies on is missing or changed its type."""


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor), e.g. ``(2, 13)``."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _private_attribute(module_name: str, attribute: str, expected_type: type | None) -> Any:
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise PrivateTorchAPIError(
            f"{module_name}.{attribute} does not exist in torch {torch.__version__}; "
            f"vescale.dtensor was checked against torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to "
            f"{TESTED_TORCH[0]}.{TESTED_TORCH[1]}. Install a torch in that range, or update "
            "vescale/dtensor/_compat.py for this release."
        )
    value = getattr(module, attribute)
    if expected_type is not None and not isinstance(value, expected_type):
        raise PrivateTorchAPIError(
            f"{module_name}.{attribute} is a {type(value).__name__} in torch {torch.__version__}, "
            f"expected {expected_type.__name__}; update vescale/dtensor/_compat.py for this release."
        )
    return value


def clear_global_module_hooks() -> None:
    """Remove every hook registered with ``torch.nn.modules.module.register_module_*_hook``."""
    for attribute in GLOBAL_MODULE_HOOK_DICTS:
        _private_attribute("torch.nn.modules.module", attribute, OrderedDict).clear()


def reset_dtensor_rng_tracker() -> None:
    """Forget DTensor's random-number tracker so that the next random DTensor op makes a new one."""
    _private_attribute("torch.distributed.tensor._random", "_rng_tracker", None)
    random_module = importlib.import_module("torch.distributed.tensor._random")
    random_module._rng_tracker = None


# --- DTensor's op dispatcher -------------------------------------------------------------
# DTensor routes every aten op through one OpDispatcher. Three of its attributes are the
# only way to extend it beyond ``register_sharding``: per-op handlers that replace the
# sharding-propagation path, the set of ops treated as random, and the propagator that
# holds the registered strategies.


def _op_dispatcher() -> Any:
    dtensor_class = _private_attribute("torch.distributed.tensor", "DTensor", type)
    if not hasattr(dtensor_class, "_op_dispatcher"):
        raise PrivateTorchAPIError(
            f"torch.distributed.tensor.DTensor._op_dispatcher does not exist in torch {torch.__version__}; "
            "update vescale/dtensor/_compat.py for this release."
        )
    return dtensor_class._op_dispatcher


def dtensor_custom_op_handlers() -> dict:
    """``{OpOverload: handler(op_call, args, kwargs)}`` that DTensor calls instead of propagating."""
    handlers = getattr(_op_dispatcher(), "_custom_op_handlers", None)
    if not isinstance(handlers, dict):
        raise PrivateTorchAPIError("DTensor._op_dispatcher._custom_op_handlers is missing or not a dict")
    return handlers


def dtensor_random_ops() -> set:
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


# --- random numbers (vescale.dtensor.random) ----------------------------------------------


# --- communication accounting (vescale.dtensor.comm) --------------------------------------
# Collectives run below autograd, where only a TorchDispatchMode sees them; torch keeps that
# class in a private module. Functional collectives name their process group by a string,
# and only a private resolver turns a name that belongs to no known mesh into its group.
# During backward, only a private query tells which autograd node is running.

FUNCTIONAL_COLLECTIVE_NAMESPACE = "_c10d_functional"
C10D_COLLECTIVE_NAMESPACE = "c10d"


def torch_dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base of vescale's dispatch modes."""
    return _private_attribute("torch.utils._python_dispatch", "TorchDispatchMode", type)


def resolve_process_group(group_name: str) -> Any:
    """The ``ProcessGroup`` registered under ``group_name`` (as functional collectives name it)."""
    resolve = _private_attribute("torch.distributed.distributed_c10d", "_resolve_process_group", None)
    return resolve(group_name)


def current_autograd_node() -> Any:
    """The autograd ``Node`` whose backward is running on this thread, or ``None`` outside backward."""
    return _private_attribute("torch._C", "_current_autograd_node", None)()


# --- placements and redistribution (vescale.dtensor.placements, .redistribute) ------------
# InterleavedShard: a DTensor stores veScale's InterleavedShard(dim, k) as PyTorch's private
# _StridedShard(dim, split_factor=k), whose layout on one mesh dim (cut the dim into k parts,
# then torch.chunk each part over the mesh dim) is the same; DTensor accepts no other type.


def strided_shard_type() -> type:
    """PyTorch's ``_StridedShard`` placement class, the form a DTensor stores an InterleavedShard in."""
    strided_shard = _private_attribute("torch.distributed.tensor.placement_types", "_StridedShard", type)
    if not isinstance(getattr(strided_shard, "split_factor", None), property):
        raise PrivateTorchAPIError(
            "torch.distributed.tensor.placement_types._StridedShard has no split_factor property in torch "
            f"{torch.__version__}; update vescale/dtensor/_compat.py for this release."
        )
    return strided_shard


# --- operator coverage and implicit replication (vescale.dtensor.ops) ---------------------
# Coverage asks DTensor which ops it can shard: the propagator's three registries (strategy
# functions, single-mesh-dim strategies, legacy rules) plus the per-op custom handlers.
# Implicit replication is one flag behind a private property; torch's public context
# manager sets it to False on exit instead of restoring it, so scoped use cannot nest.
# The autograd engine's callback queue is the only way to act once a backward pass ends.


def dtensor_strategy_registries() -> dict[str, dict]:
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
    "FUNCTIONAL_COLLECTIVE_NAMESPACE",
    "current_autograd_node",
    "dtensor_implicit_replication_enabled",
    "dtensor_strategy_registries",
    "queue_autograd_engine_callback",
    "resolve_process_group",
    "set_dtensor_implicit_replication",
    "strided_shard_type",
    "torch_dispatch_mode_class",
]
