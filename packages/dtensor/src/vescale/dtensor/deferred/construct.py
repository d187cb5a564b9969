"""``deferred_init``: build a module without allocating its parameters, recording how to.

The constructor runs on fake tensors (they report the real device, so ``nn.init``'s
``is_meta`` shortcuts are not taken) under :class:`~.recorder.InitRecorder`; every
parameter, buffer and plain tensor attribute of the result then carries a
:class:`~.record.DeferredHandle`. Nothing the size of a parameter stays allocated: a
random op's draw runs on a scratch tensor freed at once (see :mod:`.recorder` for why the
real generator must advance), and fake tensors have no storage.

Example::

    torch.manual_seed(0)
    model = deferred_init(LlamaForCausalLM, config)   # generator now where eager leaves it
    materialize_module(model)                         # the eager values, bitwise
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from vescale.dtensor import _compat
from vescale.dtensor.deferred.conversion import install_deferred_conversions
from vescale.dtensor.deferred.errors import DeferredInitError
from vescale.dtensor.deferred.record import HANDLE_ATTRIBUTE, DeferredHandle, InitRecord
from vescale.dtensor.deferred.recorder import InitRecorder
from vescale.dtensor.deferred.value_reads import deferred_fake_mode

__all__ = ["deferred_init", "module_tensors"]


def module_tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """Every ``(fqn, owner, attribute, tensor)``: parameters, buffers and plain tensor attributes.

    Tied tensors appear once per FQN (the same tensor object each time).

    Example::

        for fqn, owner, attribute, tensor in module_tensors(model):
            print(fqn, tuple(tensor.shape))
    """
    for prefix, owner in module.named_modules(remove_duplicate=False):
        tensors = {**owner._parameters, **owner._buffers}
        tensors.update(
            (name, value)
            for name, value in vars(owner).items()
            if isinstance(value, torch.Tensor) and name not in tensors
        )
        for attribute, tensor in tensors.items():
            if tensor is not None:
                yield (f"{prefix}.{attribute}" if prefix else attribute), owner, attribute, tensor


def deferred_init(module_cls_or_fn: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """Construct ``module_cls_or_fn(*args, **kwargs)`` without allocating, recording its initialisation.

    The global CPU generator ends where eager construction leaves it. Materialise with
    :func:`~vescale.dtensor.deferred.materialize_module` (any placements per FQN).

    Example::

        torch.manual_seed(0)
        model = deferred_init(GPT2LMHeadModel, config)
        materialize_module(model)
    """
    record = InitRecord()
    fake_mode = deferred_fake_mode()
    recorder = InitRecorder(record, fake_mode)
    with fake_mode, recorder:
        module = module_cls_or_fn(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise DeferredInitError(
            f"deferred_init({getattr(module_cls_or_fn, '__name__', module_cls_or_fn)!r}) returned a "
            f"{type(module).__name__}; pass a module class or a function that returns an nn.Module"
        )
    fake_tensor = _compat.fake_tensor_class()
    position = len(record.ops)
    for _, _, _, tensor in module_tensors(module):
        if isinstance(tensor, fake_tensor) and not hasattr(tensor, HANDLE_ATTRIBUTE):
            handle = DeferredHandle(record, recorder.ref(tensor), position, version=tensor._version)
            setattr(tensor, HANDLE_ATTRIBUTE, handle)
    install_deferred_conversions(module)
    return module
