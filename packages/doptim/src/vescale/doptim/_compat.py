"""The private PyTorch APIs that ``vescale.doptim`` relies on, confined to this module.

Gradient buckets must be waited for when the backward pass ends, and PyTorch offers no
public end-of-backward hook; autograd's engine has ``queue_callback``. FSDP2 passes each
unit's inputs through ``RegisterPostBackwardFunction``, whose unused outputs' gradients
autograd materialises as plain zeros, which a DTensor input cannot add up with
(:func:`unmaterialized_fsdp_post_backward`). Each accessor names
the private attribute it reads, and ``tests/test_doptim_compat.py`` fails loudly when a
PyTorch release renames or removes one.

Example::

    from vescale.doptim import _compat
    _compat.queue_end_of_backward_callback(lambda: print("backward finished"))
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

# One supported torch range and one error type for every package's _compat.py: vescale.dtensor's.
from vescale.dtensor._compat import MIN_TORCH, TESTED_TORCH, PrivateTorchAPIError, unsupported_torch
from vescale.dtensor.implicit_replication import suspended_implicit_replication

__all__ = [
    "MIN_TORCH",
    "TESTED_TORCH",
    "PrivateTorchAPIError",
    "fsdp_forward_hooks_outside_implicit_replication",
    "queue_end_of_backward_callback",
    "unmaterialized_fsdp_post_backward",
]


class _AutogradEngine(Protocol):
    def queue_callback(self, callback: Callable[[], None]) -> None: ...


def _autograd_engine() -> _AutogradEngine:
    engine: _AutogradEngine | None = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not callable(getattr(engine, "queue_callback", None)):
        raise unsupported_torch(
            "torch.autograd.Variable._execution_engine.queue_callback is missing", "vescale.doptim"
        )
    return engine


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` once the backward pass now executing finishes (call it during backward)."""
    _autograd_engine().queue_callback(callback)


_FSDP_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


# The modules of the models veScale shards at ZeRO-3: only FSDP2 units among them leave a missing
# gradient missing; any other FSDP2 model in the process keeps torch's behaviour.
_UNMATERIALIZED_MODULES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _leaves_missing_gradients_missing(param_group: Any) -> bool:
    return any(module in _UNMATERIALIZED_MODULES for module in getattr(param_group, "modules", ()))


def unmaterialized_fsdp_post_backward(model: torch.nn.Module) -> None:
    """Make FSDP2's ``RegisterPostBackwardFunction`` pass a missing gradient on as missing for the
    units inside ``model`` (idempotent; other FSDP2 models in the process are left as torch runs them).

    FSDP2 runs every input of a unit that requires grad through one autograd function (to reduce
    the unit's gradients after its backward). An input the unit does not use (Zamba2's first
    layer is handed the embeddings its hybrid layers concatenate) gets no gradient there, and
    autograd materialises one as plain zeros of the global shape; added to the DTensor gradient
    from the input's other uses, it fails: "aten.add.Tensor got mixed torch.Tensor and DTensor".
    Without materialisation the input simply receives no gradient from the unit, as without FSDP.
    The replacement decides per unit: changing every FSDP2 unit of the process broke a
    hand-written TP + FSDP2 model trained beside a veScale one (``tools/bench/e2e.py``).

    Example::

        unmaterialized_fsdp_post_backward(model)   # before fully_shard on a tensor-parallel model
    """
    _UNMATERIALIZED_MODULES.update(model.modules())
    module = importlib.import_module(_FSDP_PARAM_GROUP)
    original: Any = getattr(module, "RegisterPostBackwardFunction", None)
    if not (isinstance(original, type) and issubclass(original, torch.autograd.Function)):
        raise unsupported_torch(
            f"{_FSDP_PARAM_GROUP}.RegisterPostBackwardFunction is missing or not an autograd Function",
            "vescale.doptim",
        )
    if getattr(original, "vescale_unmaterialized", False):
        return

    if original.setup_context is torch.autograd.Function.setup_context:
        # torch 2.11: the old style, ``forward(ctx, param_group, *inputs)`` with no setup_context
        # (defining one would make autograd call forward without ctx).
        class _UnmaterializedOldStyle(original):  # type: ignore[misc]  # a class found at run time
            vescale_unmaterialized = True

            @staticmethod
            def forward(ctx: Any, param_group: Any, *inputs: Any) -> Any:
                output = original.forward(ctx, param_group, *inputs)
                if _leaves_missing_gradients_missing(param_group):
                    ctx.set_materialize_grads(False)
                return output

        setattr(module, "RegisterPostBackwardFunction", _UnmaterializedOldStyle)  # noqa: B010
        return

    class _UnmaterializedPostBackward(original):  # type: ignore[misc]  # a class found at run time
        vescale_unmaterialized = True

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            original.setup_context(ctx, inputs, output)
            if _leaves_missing_gradients_missing(inputs[0]):
                ctx.set_materialize_grads(False)

    setattr(module, "RegisterPostBackwardFunction", _UnmaterializedPostBackward)  # noqa: B010


_FORWARD_HOOK_HANDLES = ("_pre_forward_hook_handle", "_post_forward_hook_handle")


def fsdp_forward_hooks_outside_implicit_replication(model: torch.nn.Module) -> None:
    """Run the forward pre- and post-hooks of every FSDP2 unit in ``model`` with veScale's
    implicit-replication mode suspended (idempotent).

    A unit's hooks run inside the forward of the module around it, which a tensor-parallel model
    runs under ``vescale.dtensor``'s implicit-replication mode: each tensor call of FSDP2's
    all-gather bookkeeping (``numel``, ``untyped_storage``, views, ~550 a step in the e2e dp2 x
    tp2 bench) then went through the mode's Python dispatch. FSDP2 never mixes plain tensors with
    DTensors and does not need the mode. The hooks are found through the private
    ``FSDPState._pre_forward_hook_handle`` and ``_post_forward_hook_handle`` of single-module
    units (the only ones veScale makes) and replaced in place, keeping their order and flags.

    Example::

        fsdp_forward_hooks_outside_implicit_replication(model)   # after fully_shard on its units
    """
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        state = state_of()
        for name in _FORWARD_HOOK_HANDLES:
            if not hasattr(state, name):
                raise unsupported_torch(f"FSDPState.{name} is missing", "vescale.doptim")
            handle = getattr(state, name)
            hooks_of = getattr(handle, "hooks_dict_ref", None)
            hooks: dict[int, Any] | None = hooks_of() if hooks_of is not None else None
            if hooks is None:
                continue  # a unit of several modules (a _MultiHandle)
            hook = hooks.get(handle.id)
            if hook is None or getattr(hook, "vescale_outside_implicit_replication", False):
                continue  # removed, or replaced already
            hooks[handle.id] = _suspending(hook)


def _suspending(hook: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return hook(*args, **kwargs)
        with suspended_implicit_replication():
            return hook(*args, **kwargs)

    run.vescale_outside_implicit_replication = True  # type: ignore[attr-defined]
    return run
