"""Process-wide PyTorch state the test harness resets and the local-execution check reads:
global module hooks, a module's own call hooks and DTensor's random-number tracker.

Private PyTorch APIs: the module-level hook dicts of ``torch.nn.modules.module``
(``_global_forward_hooks`` & co.), ``nn.Module``'s ``_forward_pre_hooks`` & co., and
``torch.distributed.tensor._random._rng_tracker``.

Example::

    from vescale.dtensor._compat.global_state import clear_global_module_hooks
    clear_global_module_hooks()
"""

from __future__ import annotations

import functools
import importlib
from collections import OrderedDict
from typing import Any

import torch

from vescale.dtensor._compat.core import _private_attribute, unsupported_torch

__all__ = [
    "GLOBAL_CALL_HOOK_DICTS",
    "GLOBAL_MODULE_HOOK_DICTS",
    "MODULE_HOOK_DICTS",
    "clear_global_module_hooks",
    "dtensor_rng_tracker",
    "global_call_hook_count",
    "global_call_hooks",
    "module_call_hook_count",
    "module_call_hooks",
    "reset_dtensor_rng_tracker",
    "set_dtensor_rng_tracker",
]

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
