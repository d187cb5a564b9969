"""A DTensor's local tensor is laid out as its spec's strides say, after the ops where PyTorch disagrees.

``softplus_backward`` of a transposed gradient (its fake kernel orders dimensions otherwise
than CPU's) and attention on sequence-sharded inputs (gathered contiguous, spec transposed)
used to give local tensors that contradict their specs; the next ``reshape`` then failed in
the local ``view`` (Qwen3.5, Qwen3-Next, OLMo-hybrid, Electra+SP). Values are compared with the
plain tensors' results and the layout with the spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from vescale.dtensor import init_mesh
from vescale.dtensor.ops.layouts import LAYOUT_CHECKED_OPS, expected_local_stride
from vescale.dtensor.testing import run_on_ranks


def layouts_on_rank() -> dict:
    mesh = init_mesh(tp=2)
    torch.manual_seed(0)
    results = {}

    grad = torch.randn(2, 8, 8).transpose(1, 2).contiguous().transpose(1, 2)  # strides (64, 1, 8)
    x = torch.randn(2, 8, 8)
    plain = torch.ops.aten.softplus_backward(grad, x, 1, 20)
    # from_local keeps the transposed layout (distribute_tensor would make it contiguous)
    replicated = [DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (grad, x)]
    out = torch.ops.aten.softplus_backward(*replicated, 1, 20)
    results["softplus_backward"] = {
        "transposed input": replicated[0].stride() == (64, 1, 8),
        "values": torch.allclose(out.full_tensor(), plain, rtol=1e-6, atol=0),
        "layout": out.to_local().stride() == expected_local_stride(out),
        "reshape": torch.allclose(out.reshape(16, 8).full_tensor(), plain.reshape(16, 8), rtol=1e-6, atol=0),
    }

    # (batch, seq, heads, dim) viewed as (batch, heads, seq, dim): strides (512, 8, 64, 1)
    q, k, v = (torch.randn(2, 8, 8, 8).transpose(1, 2) for _ in range(3))
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sharded = [distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*sharded, is_causal=True)
    results["attention, sequence-sharded"] = {
        "values": torch.allclose(out.full_tensor(), plain, atol=1e-6),
        "layout": out.to_local().stride() == expected_local_stride(out),
        "reshape": torch.allclose(
            out.transpose(1, 2).reshape(2, 8, 64).full_tensor(), plain.transpose(1, 2).reshape(2, 8, 64)
        ),
    }
    return results


def test_local_layouts_follow_the_spec_after_the_checked_ops():
    assert torch.ops.aten.softplus_backward.default in LAYOUT_CHECKED_OPS
    for rank, results in enumerate(run_on_ranks(layouts_on_rank, world_size=2)):
        for name, checks in results.items():
            assert all(checks.values()), (rank, name, checks)
