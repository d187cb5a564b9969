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


def fake_tokens_through_real_expert_dtensors_on_rank() -> tuple[tuple[int, ...], str]:
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    import vescale.dtensor.ops  # noqa: F401  # the grouped_mm handler

    mesh = init_device_mesh("cpu", (1,))
    tokens, experts, offsets = _operands()
    # The experts: a real parameter, already where the handler wants it (Replicate on one rank).
    weight = torch.nn.Parameter(DTensor.from_local(experts, mesh, [Replicate()]))
    with (
        torch.no_grad(),
        _compat.fake_tensor_mode_class()(allow_non_fake_inputs=True) as fake_mode,
        GroupedMatmulShapes(),
    ):
        fake_tokens = DTensor.from_local(fake_mode.from_tensor(tokens), mesh, [Replicate()])
        out = torch._grouped_mm(fake_tokens, weight, offs=offsets)
    return tuple(out.shape), type(out.to_local()).__name__


def test_fake_tokens_meet_real_expert_dtensors_without_moving_them():
    # A shapes-only pass over a tensor-parallel MoE (dpipe's split of GPT-OSS, Aria): moving the
    # weight to where it already is ran DTensor's Redistribute, whose in-place detach of the real
    # parameter's local tensor the fake mode refused.
    from vescale.dtensor.testing import run_on_ranks

    shape, local_type = run_on_ranks(fake_tokens_through_real_expert_dtensors_on_rank, 1)[0]
    assert shape == (TOKENS, OUT) and local_type == "FakeTensor"
