"""``aten._grouped_mm`` on tensors without data (meta or fake), in any dtype.

Structure analyses run a model's forward on tensors that have shapes but no data: the planner
on meta tensors, dpipe's split on fake ones (``FakeTensorMode``). ``transformers`` runs
mixture-of-experts layers (Mixtral's experts) through ``torch._grouped_mm``, whose meta
function implements the CUDA kernel's checks and rejects every dtype but bfloat16 (torch
2.13), so a float32 Mixtral's analysis fails although the CPU kernel would run it.
:class:`GroupedMatmulShapes` answers the op with an empty output of the right shape and
dtype whenever an operand holds no data; every other op, and ``_grouped_mm`` on real
tensors, runs as it is; DTensor's handler (:mod:`vescale.dtensor.ops.grouped_mm`) answers
data-less local operands the same way. The mode sits below autograd, so the op's saved inputs are still seen
by ``saved_tensors_hooks``.

Example::

    with FakeTensorMode(allow_non_fake_inputs=True), GroupedMatmulShapes():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))   # a float32 Mixtral
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vescale.dtensor import _compat

__all__ = ["GroupedMatmulShapes", "empty_grouped_mm_output", "grouped_mm_output_shape", "holds_no_data"]


def grouped_mm_output_shape(mat_a: torch.Tensor, mat_b: torch.Tensor) -> tuple[int, ...]:
    """The output shape of ``torch._grouped_mm(mat_a, mat_b, offs=...)``.

    (tokens, in) x (experts, in, out) -> (tokens, out); 3-D x 3-D keeps the batch dim.

    Example::

        grouped_mm_output_shape(torch.empty(6, 4), torch.empty(2, 4, 8))   # (6, 8)
    """
    rows = mat_a.shape[0] if mat_a.ndim == 2 else mat_a.shape[1]
    if mat_a.ndim == 2:
        return (rows, mat_b.shape[-1])
    return (mat_a.shape[0], rows, mat_b.shape[-1])


def holds_no_data(tensor: Any) -> bool:
    """Whether ``tensor`` is a meta or fake tensor (shapes only), e.g. during a structure analysis."""
    if not isinstance(tensor, torch.Tensor):
        return False
    return tensor.is_meta or isinstance(tensor, _compat.fake_tensor_class())


def empty_grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, out_dtype: Any = None) -> torch.Tensor:
    """An empty tensor shaped like ``torch._grouped_mm(mat_a, mat_b, ...)``'s output, on the data-less
    operand's device (under ``FakeTensorMode`` it is fake too).

    Example::

        out = empty_grouped_mm_output(fake_tokens, experts)   # fake (tokens, out)
    """
    device = mat_a.device if holds_no_data(mat_a) else mat_b.device
    return torch.empty(grouped_mm_output_shape(mat_a, mat_b), dtype=out_dtype or mat_a.dtype, device=device)


if TYPE_CHECKING:
    from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
else:
    _DispatchModeBase = _compat.torch_dispatch_mode_class()


class GroupedMatmulShapes(_DispatchModeBase):
    """Answer ``aten._grouped_mm`` on meta or fake operands with an empty output of the right
    shape and dtype (see the module docstring); everything else runs unchanged.

    Example::

        with meta_parameters(model), GroupedMatmulShapes():
            model(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))
    """

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and (holds_no_data(args[0]) or holds_no_data(args[1])):
            return empty_grouped_mm_output(args[0], args[1], kwargs.get("out_dtype"))
        return func(*args, **kwargs)
