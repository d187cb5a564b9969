"""Local results laid out as their DTensor's strides say, for ops where PyTorch's two disagree.

DTensor takes an output's strides from a fake-tensor run of the op on the *global* input
specs, then runs the real kernel on the *local* tensors. Two things make them disagree:

- a fake kernel that orders dimensions otherwise than the real one (``softplus_backward``:
  from a transposed gradient and a contiguous input, CPU keeps the gradient's order, the
  fake kernel the input's);
- inputs redistributed before the kernel runs: a gather returns a contiguous local tensor
  while the spec keeps the original (transposed) strides, so attention's output is
  contiguous locally and transposed by its spec (Electra under sequence parallelism).

A DTensor whose local strides contradict its spec breaks later: ``reshape`` on the DTensor
picks a view because the spec says the memory is dense in that order, and the local
``view`` fails ("view size is not compatible with input tensor's size and stride"; Qwen3.5,
Qwen3-Next, OLMo-hybrid, Electra+SP). Here each such op's local results are copied into the
layout the spec implies when, and only when, they differ; values never change.

Example::

    import vescale.dtensor.ops.layouts  # registers the handlers
    grad_x = torch.ops.aten.softplus_backward(grad_out_dtensor, x_dtensor, 1, 20)
    assert grad_x.to_local().stride() == expected_local_stride(grad_x)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vescale.dtensor._op_handlers import dispatch_previous, register_op_handlers
from vescale.dtensor.placements import from_local_like

__all__ = ["LAYOUT_CHECKED_OPS", "expected_local_stride", "match_spec_layout"]

aten = torch.ops.aten


def _existing(*names: str) -> list[Any]:
    ops = []
    for name in names:
        packet_name, _, overload = name.partition(".")
        packet = getattr(aten, packet_name, None)
        if packet is not None and hasattr(packet, overload):
            ops.append(getattr(packet, overload))
    return ops


# Ops measured to return local layouts that contradict their specs (see the module docstring);
# attention kernels run after their inputs are gathered under sequence parallelism.
LAYOUT_CHECKED_OPS = tuple(
    _existing(
        "softplus_backward.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_flash_attention_for_cpu_backward.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_flash_attention_backward.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_efficient_attention_backward.default",
        "_scaled_dot_product_cudnn_attention.default",
        "_scaled_dot_product_cudnn_attention_backward.default",
    )
)


def expected_local_stride(tensor: DTensor) -> tuple[int, ...] | None:
    """The dense local strides in the memory order of ``tensor``'s global strides, or None.

    None when the global strides are not a dense permutation (a strided view), where no
    single local layout follows from them.

    Example::

        # global (2, 8, 8) with strides (64, 1, 8): dimension 1 innermost
        expected_local_stride(dtensor)  # (64, 1, 8) for a replicated one
    """
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    local_shape = tuple(tensor.to_local().shape)
    order = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -stride[d])
    running = 1
    for d in reversed(order):
        if stride[d] != running:
            return None
        running *= shape[d]
    local_stride = [0] * len(shape)
    running = 1
    for d in reversed(order):
        local_stride[d] = running
        running *= max(local_shape[d], 1)
    for d in range(len(shape)):
        if shape[d] == 1:  # any stride describes a size-1 dimension: keep the local one
            local_stride[d] = tensor.to_local().stride(d)
    return tuple(local_stride)


def _agrees(local: torch.Tensor, stride: tuple[int, ...]) -> bool:
    return all(size <= 1 or local.stride(d) == stride[d] for d, size in enumerate(local.shape))


def match_spec_layout(result: Any) -> Any:
    """``result`` with every DTensor's local tensor in the layout its spec implies (copied if not).

    Example::

        out = match_spec_layout(dispatch_previous(op_call, args, kwargs))
    """
    if isinstance(result, (tuple, list)):
        return type(result)(match_spec_layout(item) for item in result)
    if not isinstance(result, DTensor):
        return result
    local = result.to_local()
    stride = expected_local_stride(result)
    if stride is None or local.numel() == 0 or _agrees(local, stride):
        return result
    relaid = torch.empty_strided(local.shape, stride, dtype=local.dtype, device=local.device)
    relaid.copy_(local)
    return from_local_like(relaid, result)


def _layout_checked(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    return match_spec_layout(dispatch_previous(op_call, args, kwargs))


register_op_handlers(dict.fromkeys(LAYOUT_CHECKED_OPS, _layout_checked))
