"""Deferred initialisation, the DModule entry: build a model without allocating it, then
let each rank allocate only its shards, with the values eager construction gives.

The record and the materialisation live in :mod:`vescale.dtensor.deferred` (the protocol
that dmodule's TP, doptim's ZeRO-3 and dpipe all materialise from); this module is the
user-facing name.

Example::

    torch.manual_seed(0)
    model = deferred_init(LlamaForCausalLM, config)          # no parameter memory
    materialize_module(model, {"lm_head.weight": (mesh, [Shard(0)])})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from vescale.dtensor.deferred import (
    DeferredInitError,
    DeferredPlacementError,
    NotDeferredError,
    is_deferred,
    materialize_module,
    materialize_tensor,
)
from vescale.dtensor.deferred import deferred_init as _record_deferred_init

__all__ = [
    "DeferredInitError",
    "DeferredPlacementError",
    "NotDeferredError",
    "deferred_init",
    "is_deferred",
    "materialize_module",
    "materialize_tensor",
]


def deferred_init(module_cls_or_fn: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """Construct ``module_cls_or_fn(*args, **kwargs)`` on fake tensors, recording its initialisation.

    Parameters and buffers hold no memory until :func:`materialize_module` (or a plan's
    materialisation) replays their ops; the global CPU generator ends where eager
    construction would leave it.

    Example::

        torch.manual_seed(0)
        model = deferred_init(GPT2LMHeadModel, config)
        materialize_module(model)   # bitwise the model GPT2LMHeadModel(config) would give
    """
    return _record_deferred_init(module_cls_or_fn, *args, **kwargs)
