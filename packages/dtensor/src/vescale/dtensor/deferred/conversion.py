"""dtype and device conversions of a deferred module: ``model.to(torch.bfloat16)``, ``.double()``.

``nn.Module._apply`` swaps a fake parameter for its converted copy (``torch.utils.swap_tensors``),
which fails on the fake tensors deferred construction leaves, and would drop their
:class:`~.record.DeferredHandle` if it did not. So :func:`deferred_init` gives each module of
the result its own ``_apply``: a deferred tensor is converted in place (the same object, so
tied parameters stay tied, as eager ``.to`` keeps them), and its handle records the dtype and
device it now has; materialisation replays the construction as recorded and converts the
result, which is what eager construction followed by the same ``.to`` computes. A module
with no deferred tensor left goes back to its class's ``_apply`` (FSDP2's, an RNN's).

Example::

    model = deferred_init(LlamaForCausalLM, config).to(torch.bfloat16)   # still no memory
    materialize_module(model)            # bitwise LlamaForCausalLM(config).to(torch.bfloat16)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from vescale.dtensor import _compat
from vescale.dtensor.deferred.errors import DeferredInitError
from vescale.dtensor.deferred.record import HANDLE_ATTRIBUTE, deferred_handle, is_deferred

__all__ = ["convert_deferred_tensor", "drop_deferred_conversions", "install_deferred_conversions"]

# The instance attribute that shadows the class's ``_apply`` while a module holds deferred tensors.
_APPLY = "_apply"


def install_deferred_conversions(module: nn.Module) -> None:
    """Give ``module`` and every submodule the deferred-aware ``_apply`` (see the module docstring).

    Example::

        install_deferred_conversions(model)   # deferred_init does this
        model.double()                         # converts the deferred tensors in place
    """
    for prefix, submodule in module.named_modules():
        object.__setattr__(submodule, _APPLY, functools.partial(_apply_deferred, submodule, prefix))


def drop_deferred_conversions(module: nn.Module) -> None:
    """Give each module of ``module`` without a deferred tensor left its class's ``_apply`` back.

    Example::

        materialize_module(model)   # calls it: model.to(...) is torch's own from here on
    """
    for submodule in module.modules():
        if not _own_deferred(submodule):
            submodule.__dict__.pop(_APPLY, None)


def _own_deferred(module: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """The (store, key) of each deferred parameter and buffer ``module`` itself holds."""
    return [
        (store, key)
        for store in (module._parameters, module._buffers)
        for key, tensor in store.items()
        if tensor is not None and is_deferred(tensor)
    ]


def convert_deferred_tensor(tensor: torch.Tensor, fn: Callable[[torch.Tensor], Any], where: str) -> None:
    """Convert the deferred ``tensor`` in place to what ``fn`` (a dtype or device conversion) makes of it.

    Example::

        convert_deferred_tensor(model.lm_head.weight, lambda t: t.to(torch.bfloat16), "lm_head.weight")
    """
    handle = deferred_handle(tensor, where)
    with torch.no_grad():
        applied = fn(tensor)
    if applied is tensor:
        return
    if not isinstance(applied, _compat.fake_tensor_class()) or applied.shape != tensor.shape:
        raise DeferredInitError(
            f"{where} (shape {tuple(tensor.shape)}) is deferred, and the module conversion made a "
            f"{type(applied).__name__} of shape {tuple(getattr(applied, 'shape', ()))} from it: a deferred "
            "module takes dtype and device conversions only (model.to(torch.bfloat16), .double(), "
            ".to(device)); materialise it first (vescale.parallelize, or materialize_module) for any other"
        )
    device_changed = applied.device != tensor.device
    tensor.data = applied
    if device_changed:
        tensor.fake_device = applied.device  # type: ignore[attr-defined]  # FakeTensor's own attribute
    converted = dataclasses.replace(
        handle, dtype=applied.dtype, device=applied.device, version=tensor._version
    )
    setattr(tensor, HANDLE_ATTRIBUTE, converted)


def _class_apply(module: nn.Module) -> Callable[..., nn.Module]:
    """``module``'s own ``_apply`` as its class defines it (torch leaves ``_apply`` unannotated)."""
    return cast(Callable[..., nn.Module], functools.partial(type(module)._apply, module))


def _apply_deferred(
    module: nn.Module, prefix: str, fn: Callable[[torch.Tensor], Any], recurse: bool = True
) -> nn.Module:
    stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
    deferred = _own_deferred(module)
    if not deferred:
        # Nothing deferred here any more: the class's own _apply (FSDP2's, an RNN's) from now on.
        module.__dict__.pop(_APPLY, None)
        return _class_apply(module)(fn, recurse)
    if recurse:
        for child in module.children():
            cast(Callable[..., nn.Module], child._apply)(fn)
    for store, key in deferred:
        convert_deferred_tensor(store[key], fn, f"{prefix}.{key}" if prefix else key)
    if len(deferred) == sum(1 for store in stores for value in store.values() if value is not None):
        return module
    # A module partly materialised: the class's _apply converts the rest, the deferred ones hidden.
    orders = [list(store) for store in stores]
    hidden = {(id(store), key): store.pop(key) for store, key in deferred}
    try:
        _class_apply(module)(fn, recurse=False)
    finally:
        for store, order in zip(stores, orders, strict=True):
            entries = {key: hidden.get((id(store), key), store.get(key)) for key in order}
            store.clear()
            store.update(entries)
    return module
