"""This rank's experts on the rows dispatched to it: a grouped GEMM, or a loop over experts.

The math is that of ``transformers``' fused experts (``use_experts_implementation``): the
up projection (``gate_up_proj``, or ``up_proj`` without a gate; ``is_transposed`` weights are
(experts, in, out)), optional per-expert biases, the module's own ``_apply_gate`` (which
knows concatenated or interleaved gate/up halves) or activation, then ``down_proj``. The
expert parameters are the rank's local shards (E/ep whole experts).

The GEMMs run as ``torch.nn.functional.grouped_mm`` where PyTorch has it for the device and
dtype (CPU: float32 and bfloat16 with 16-byte-aligned strides; CUDA: bfloat16 on compute
capability 8.0 and newer), else as one matmul per local expert. Both keep every local expert
in the autograd graph (an expert without rows computes an empty product), so each gets a
gradient, zero when it received nothing.

Example::

    compute = LocalExperts(model.model.layers[0].mlp.experts)
    out = compute(rows, counts)   # rows grouped by local expert, counts per local expert
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from vescale.dmodule.experts.errors import UnsupportedExpertsError
from vescale.dtensor.grouped_mm_shapes import holds_no_data

__all__ = ["LocalExperts", "grouped_mm_supported"]


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _aligned(tensor: torch.Tensor) -> bool:
    if holds_no_data(tensor):  # a shapes-only pass (GroupedMatmulShapes answers the op): no address
        return True
    alignment = 16 // tensor.element_size()
    return tensor.data_ptr() % 16 == 0 and all(
        stride % alignment == 0 for stride in tensor.stride() if stride != 1
    )


def grouped_mm_supported(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm(rows, weight, offs=...)`` runs on this device, dtype and layout.

    Example::

        grouped_mm_supported(torch.randn(6, 32), torch.randn(2, 32, 16))   # True on CPU, torch 2.13
    """
    if not hasattr(F, "grouped_mm") or rows.dtype != weight.dtype:
        return False
    if weight.device.type == "cpu":
        return weight.dtype in (torch.float32, torch.bfloat16) and _aligned(rows) and _aligned(weight)
    if weight.device.type == "cuda":
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    return False


class LocalExperts:
    """Callable ``(rows, counts) -> outputs`` over the local shards of one experts module.

    ``use_grouped_mm=None`` picks the grouped GEMM where :func:`grouped_mm_supported`, ``False``
    forces the per-expert loop (tests compare both).

    Example::

        outputs = LocalExperts(experts, use_grouped_mm=False)(rows, torch.tensor([3, 0]))
    """

    def __init__(self, experts: nn.Module, *, use_grouped_mm: bool | None = None) -> None:
        if getattr(experts, "has_post_expert_norm", False):
            raise UnsupportedExpertsError(
                f"{type(experts).__name__} normalises each expert's output (has_post_expert_norm); the "
                "expert-parallel forward does not implement it: leave this model's experts replicated"
            )
        params = experts._parameters
        # A transformers experts module: act_fn and _apply_gate are the model's own.
        self.experts: Any = experts
        self.has_gate = bool(getattr(experts, "has_gate", "gate_up_proj" in params))
        self.up_name = "gate_up_proj" if self.has_gate else "up_proj"
        self.is_transposed = bool(getattr(experts, "is_transposed", False))
        self.has_bias = params.get(f"{self.up_name}_bias") is not None
        self.use_grouped_mm = use_grouped_mm

    def _linear(
        self, rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        # transformers' layout: (experts, out, in), or (experts, in, out) when transposed.
        weight_in_out = weight if self.is_transposed else weight.transpose(-2, -1)
        rows = rows.to(weight.dtype)
        use_grouped = self.use_grouped_mm
        if use_grouped is None:
            use_grouped = grouped_mm_supported(rows, weight_in_out)
        if use_grouped:
            return F.grouped_mm(rows, weight_in_out, offs=offsets)
        pieces = torch.split(rows, counts.tolist())
        return torch.cat([piece @ weight_in_out[j] for j, piece in enumerate(pieces)])

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        params = self.experts._parameters
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        expert_of_row = None
        if self.has_bias:
            expert_of_row = torch.repeat_interleave(
                torch.arange(counts.numel(), device=rows.device), counts, output_size=rows.shape[0]
            )
        projected = self._linear(rows, _local(params[self.up_name]), counts, offsets)
        if expert_of_row is not None:
            projected = projected + _local(params[f"{self.up_name}_bias"])[expert_of_row]
        if self.has_gate and hasattr(self.experts, "_apply_gate"):
            projected = self.experts._apply_gate(projected)
        elif self.has_gate:
            gate, up = projected.chunk(2, dim=-1)
            projected = self.experts.act_fn(gate) * up
        else:
            projected = self.experts.act_fn(projected)
        output = self._linear(projected, _local(params["down_proj"]), counts, offsets)
        if expert_of_row is not None:
            output = output + _local(params["down_proj_bias"])[expert_of_row]
        return output
