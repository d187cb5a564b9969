"""Routers computed in float32 in a lower-precision model: logits, scores and top-k.

``transformers``' Mixtral and Qwen3-MoE routers compute their logits in the model's dtype
(bfloat16 in mixed-precision training) and only the softmax in float32; DeepSeek-V3's
computes everything in float32. In bfloat16 near-ties between experts then round to ties and
the top-k choice depends on rounding. :func:`route_in_float32` runs a router's own forward on
float32 copies of its parameters and input, swapped in for the call only (the module class
and its parameters are untouched, and gradients flow back to the low-precision parameters).

Example::

    for block in find_moe_blocks(model):
        route_in_float32(model.get_submodule(block.router_fqn))
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from torch import nn

__all__ = ["FLOAT32_ROUTER_ATTRIBUTE", "route_in_float32"]

# A router whose forward route_in_float32 replaced keeps its class's forward under this attribute.
FLOAT32_ROUTER_ATTRIBUTE = "_vescale_float32_router"


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def _float32_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    class_forward = getattr(self, FLOAT32_ROUTER_ATTRIBUTE)
    # The router's own tensors, swapped for float32 copies for this call only (the copies are
    # differentiable, so gradients reach the originals). The class forward is called directly:
    # the module's hooks already ran around this call and must not run twice.
    # For this call the parameter slots hold plain float32 tensors, as the buffer slots do.
    parameter_slots = cast(dict[str, torch.Tensor | None], self._parameters)
    originals = [
        (slots, name, tensor)
        for slots in (parameter_slots, self._buffers)
        for name, tensor in slots.items()
        if tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float32
    ]
    for slots, name, tensor in originals:
        slots[name] = tensor.float()
    try:
        return class_forward(self, *map(_float32, args), **{key: _float32(v) for key, v in kwargs.items()})
    finally:
        for slots, name, tensor in originals:
            slots[name] = tensor


def route_in_float32(router: nn.Module) -> nn.Module:
    """Make ``router`` compute in float32 whatever its parameters' dtype (in place; idempotent).

    Example::

        route_in_float32(model.model.layers[0].mlp.gate)
        logits, scores, index = model.model.layers[0].mlp.gate(hidden_bf16)   # float32 logits
    """
    if getattr(router, FLOAT32_ROUTER_ATTRIBUTE, None) is None:
        setattr(router, FLOAT32_ROUTER_ATTRIBUTE, type(router).forward)
        router.forward = types.MethodType(_float32_forward, router)
    return router
