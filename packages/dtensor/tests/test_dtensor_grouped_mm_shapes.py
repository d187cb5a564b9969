"""``GroupedMatmulShapes``: ``aten._grouped_mm`` on meta and fake tensors in float32, single process.

Reference: the CPU kernel on real tensors of the same shapes (its output's shape and dtype),
and, for real operands under the mode, its values bitwise (the mode must not touch them).
"""

from __future__ import annotations

import torch

from vescale.dtensor import _compat
from vescale.dtensor.grouped_mm_shapes import GroupedMatmulShapes, holds_no_data

TOKENS, IN, OUT, EXPERTS = 6, 16, 8, 2


def _operands(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(TOKENS, IN, generator=generator)
    experts = torch.randn(EXPERTS, IN, OUT, generator=generator)
    offsets = torch.tensor([4, TOKENS], dtype=torch.int32)
    return tokens.to(device), experts.to(device), offsets.to(device)


def test_meta_and_fake_float32_operands_get_the_kernels_output_shape():
    tokens, experts, offsets = _operands()
    expected = torch._grouped_mm(tokens, experts, offs=offsets)
    meta = _operands("meta")
    with GroupedMatmulShapes():
        out = torch._grouped_mm(*meta[:2], offs=meta[2])
    assert out.is_meta and out.shape == expected.shape and out.dtype == torch.float32
    with _compat.fake_tensor_mode_class()(allow_non_fake_inputs=True) as fake_mode, GroupedMatmulShapes():
        fake_tokens = fake_mode.from_tensor(tokens)
        out = torch._grouped_mm(fake_tokens, experts, offs=offsets)  # real experts, as a model's weights
    assert holds_no_data(out) and out.shape == expected.shape and out.dtype == torch.float32


def test_real_operands_run_the_kernel_unchanged():
    tokens, experts, offsets = _operands()
    with GroupedMatmulShapes():
        out = torch._grouped_mm(tokens, experts, offs=offsets)
    assert torch.equal(out, torch._grouped_mm(tokens, experts, offs=offsets))
