"""The selective checkpointing policy keeps what its docstring says, and nothing cheap to redo."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from vescale.planner.selective import selective_policy

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
FORWARD = SelectiveCheckpointContext(is_recompute=False)


@pytest.mark.parametrize(
    "op",
    [
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._grouped_mm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        c10d.all_reduce.default,
        c10d.reduce_scatter_tensor.default,
    ],
)
def test_matmuls_attention_kernels_and_reductions_are_kept(op):
    assert selective_policy(FORWARD, op) == CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize(
    "op",
    [
        aten.mul.Tensor,
        aten.silu.default,
        aten.rsqrt.default,
        aten._softmax.default,
        aten.native_dropout.default,
        aten.cat.default,
        c10d.all_gather_into_tensor.default,
        c10d.wait_tensor.default,
    ],
)
def test_element_wise_ops_and_all_gathers_are_recomputed(op):
    assert selective_policy(FORWARD, op) == CheckpointPolicy.PREFER_RECOMPUTE
