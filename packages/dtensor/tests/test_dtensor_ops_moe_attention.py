"""MoE expert matmul, routing arithmetic, lenient views and grouped-query attention on DTensors,
each against the same computation on full tensors in one process.

Tolerances: results that only move or select values (views, floor_divide) are compared
bitwise; matmuls and attention within 1e-5 relative, because a shard's matmul runs on a
narrower matrix than the reference's and BLAS may block (and round) it differently.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import vescale.dtensor.ops  # noqa: F401  (registers the strategies and handlers)
from vescale.dtensor.placements import InterleavedShard
from vescale.dtensor.placements import distribute_tensor as distribute_interleaved
from vescale.dtensor.testing import run_on_ranks

RTOL = 1e-5


def _experts_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randn(10, 8, generator=generator)
    experts = torch.randn(4, 8, 12, generator=generator)
    # Group sizes 3, 0, 5, 2: an expert without tokens included.
    offsets = torch.tensor([3, 3, 8, 10], dtype=torch.int32)
    output_weight = torch.randn(10, 12, generator=generator)
    return tokens, experts, offsets, output_weight


def _experts_step(tokens, experts, offsets, output_weight):
    out = torch._grouped_mm(tokens, experts, offs=offsets)
    (out * output_weight).sum().backward()
    return out


def grouped_mm_on_ranks(experts_placement: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens, experts, offsets, output_weight = _experts_inputs()
    placement = {"S(2)": Shard(2), "S(1)": Shard(1), "IS(2,2)": InterleavedShard(2, 2)}[experts_placement]
    tokens_placement = Shard(1) if experts_placement == "S(1)" else Replicate()
    sharded_tokens = distribute_tensor(tokens, mesh, [tokens_placement]).requires_grad_(True)
    sharded_experts = distribute_interleaved(experts, mesh, [placement]).requires_grad_(True)
    # The output's gradient arrives sharded like the output, as from the next layer in a model.
    weight_placement = {"S(2)": Shard(1), "IS(2,2)": InterleavedShard(1, 2), "S(1)": Replicate()}
    weight = distribute_interleaved(output_weight, mesh, [weight_placement[experts_placement]])
    out = _experts_step(
        sharded_tokens, sharded_experts, distribute_tensor(offsets, mesh, [Replicate()]), weight
    )
    return (
        out.placements,
        out.full_tensor(),
        sharded_tokens.grad.full_tensor(),
        sharded_experts.grad.placements,
        sharded_experts.grad.full_tensor(),
    )


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual - expected).abs().max() <= RTOL * expected.abs().max()


def test_grouped_mm_in_float32_keeps_expert_sharding_forward_and_backward():
    tokens, experts, offsets, output_weight = _experts_inputs()
    tokens.requires_grad_(True)
    experts.requires_grad_(True)
    expected_out = _experts_step(tokens, experts, offsets, output_weight).detach()
    strided = InterleavedShard(2, 2).to_torch()
    for experts_placement, out_placement in (
        ("S(2)", Shard(1)),
        ("IS(2,2)", InterleavedShard(1, 2).to_torch()),
        ("S(1)", Partial()),
    ):
        out_placements, out, tokens_grad, experts_grad_placements, experts_grad = run_on_ranks(
            grouped_mm_on_ranks, 2, args=(experts_placement,)
        )[0]
        assert out_placements == (out_placement,), experts_placement
        _assert_close(out, expected_out)
        _assert_close(tokens_grad, tokens.grad)
        _assert_close(experts_grad, experts.grad)
        # The experts' gradient keeps the experts' sharding (no gather of the weight).
        expected_grad_placement = {"S(2)": Shard(2), "IS(2,2)": strided, "S(1)": Shard(1)}[experts_placement]
        assert experts_grad_placements == (expected_grad_placement,), experts_placement


def routing_arithmetic_on_ranks():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    slots = torch.arange(16).flip(0)
    sharded = distribute_tensor(slots, mesh, [Shard(0)])
    token_index = sharded // 2
    by_tensor = torch.floor_divide(distribute_tensor(slots, mesh, [Replicate()]), torch.tensor(2))
    grads = distribute_tensor(torch.arange(16.0 * 4).view(16, 4), mesh, [Shard(0)])
    # 16 tokens on 4 ranks cannot become (2, 8) tokens and stay sharded on the first dim.
    unflattened = grads.view(2, 8, 4)
    # A size-1 dim sharded over 4 ranks (XLNet's batch of one, seq-first, under sequence
    # parallelism) cannot be viewed away and stay sharded: PyTorch's strict view refused it.
    single = distribute_tensor(torch.arange(8.0 * 4).view(8, 1, 4), mesh, [Shard(1)])
    squeezed = single.view(1, 8, 4)
    return (
        token_index.placements,
        token_index.full_tensor(),
        by_tensor.full_tensor(),
        unflattened.full_tensor(),
        squeezed.full_tensor(),
    )


def test_floor_divide_keeps_sharding_and_uneven_view_redistributes_instead_of_raising():
    results = run_on_ranks(routing_arithmetic_on_ranks, 4)[0]
    placements, token_index, by_tensor, unflattened, squeezed = results
    slots = torch.arange(16).flip(0)
    assert placements == (Shard(0),)
    assert torch.equal(token_index, slots // 2)
    assert torch.equal(by_tensor, slots // 2)
    assert torch.equal(unflattened, torch.arange(16.0 * 4).view(2, 8, 4))
    assert torch.equal(squeezed, torch.arange(8.0 * 4).view(1, 8, 4))


def _attention_inputs(key_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(2, 12, 6, 4, generator=generator)
    key = torch.randn(2, key_heads, 6, 4, generator=generator)
    value = torch.randn(2, key_heads, 6, 4, generator=generator)
    return query, key, value


def grouped_query_attention_on_ranks(key_heads: int):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tensors = [
        distribute_tensor(tensor, mesh, [Shard(1)]).requires_grad_(True)
        for tensor in _attention_inputs(key_heads)
    ]
    out = F.scaled_dot_product_attention(*tensors, is_causal=True, enable_gqa=True)
    out.sum().backward()
    assert isinstance(out, DTensor)
    return out.full_tensor(), [tensor.grad.full_tensor() for tensor in tensors]


def test_grouped_query_attention_pairs_query_groups_with_their_key_heads():
    # 6 key/value heads on 4 ranks chunk as 2|2|2|0 while 12 query heads chunk as 3|3|3|3:
    # head sharding would pair query heads with the wrong key heads, so it must not be used.
    for key_heads in (4, 6):
        tensors = [tensor.requires_grad_(True) for tensor in _attention_inputs(key_heads)]
        expected = F.scaled_dot_product_attention(*tensors, is_causal=True, enable_gqa=True)
        expected.sum().backward()
        out, grads = run_on_ranks(grouped_query_attention_on_ranks, 4, args=(key_heads,))[0]
        _assert_close(out, expected.detach())
        for grad, tensor in zip(grads, tensors, strict=True):
            _assert_close(grad, tensor.grad)


def grouped_query_attention_on_a_2d_mesh(key_heads: int, head_placements: tuple) -> tuple:
    mesh = init_device_mesh("cpu", (2, 2))
    tensors = [
        distribute_tensor(tensor, mesh, list(head_placements)).requires_grad_(True)
        for tensor in _attention_inputs(key_heads)
    ]
    out = F.scaled_dot_product_attention(*tensors, is_causal=True, enable_gqa=True)
    out.sum().backward()
    return out.placements, out.full_tensor(), [tensor.grad.full_tensor() for tensor in tensors]


# (key heads, placements of q/k/v heads on a 2 x 2 mesh, expected output placements).
MESH_2D_CASES = (
    # 2 key heads in 2 chunks over the second mesh dim alone (as tp in dp x tp): the heads stay
    # sharded; bounding the chunks by the whole mesh (4) gathered them.
    (2, (Replicate(), Shard(1)), (Replicate(), Shard(1))),
    # 6 key heads in 2 x 2 = 4 chunks (2|2|2|0 against 12 query heads' 3|3|3|3) would mispair
    # query groups: the heads are gathered on one mesh dim, so that 2 chunks remain.
    (6, (Shard(1), Shard(1)), "not 4 head chunks"),
)


def test_grouped_query_head_chunks_count_the_mesh_dims_that_shard_the_heads():
    for key_heads, head_placements, expected_placements in MESH_2D_CASES:
        tensors = [tensor.requires_grad_(True) for tensor in _attention_inputs(key_heads)]
        expected = F.scaled_dot_product_attention(*tensors, is_causal=True, enable_gqa=True)
        expected.sum().backward()
        placements, out, grads = run_on_ranks(
            grouped_query_attention_on_a_2d_mesh, 4, args=(key_heads, head_placements)
        )[0]
        if isinstance(expected_placements, tuple):
            assert placements == expected_placements
        else:
            assert placements.count(Shard(1)) < 2, placements
        _assert_close(out, expected.detach())
        for grad, tensor in zip(grads, tensors, strict=True):
            _assert_close(grad, tensor.grad)
