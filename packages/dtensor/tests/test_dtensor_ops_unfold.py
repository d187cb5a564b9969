"""``unfold`` of a DTensor and its gradient give the single-device values.

Inkling-2's windowed attention unfolds head-sharded keys along the sequence; DTensor had no
strategy for ``unfold`` or ``unfold_backward``. Compared with plain tensors: the windows of a
tensor sharded on another dim, of a Partial one, and of one sharded on the windowed dim
(gathered first), and the gradient back through them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks


def unfold_on_rank() -> dict:
    mesh = init_mesh(tp=2)
    torch.manual_seed(0)
    values = torch.randn(2, 4, 8, 3)
    weights = torch.randn(2, 4, 7, 3, 2)
    plain = values.clone().requires_grad_()
    (plain.unfold(2, 2, 1) * weights).sum().backward()
    results = {}
    for name, placements in (("head-sharded", [Shard(1)]), ("window-dim-sharded", [Shard(2)])):
        leaf = distribute_tensor(values, mesh, placements).requires_grad_()
        windows = leaf.unfold(2, 2, 1)
        (windows * distribute_tensor(weights, mesh, [Shard(1)])).sum().backward()
        results[name] = {
            "windows": torch.equal(windows.full_tensor(), values.unfold(2, 2, 1)),
            "gradient": torch.allclose(leaf.grad.full_tensor(), plain.grad, rtol=1e-6, atol=1e-6),
        }
    partial = DTensor.from_local(values / 2, mesh, [Partial()], run_check=False).unfold(2, 2, 1)
    results["partial"] = {"windows": torch.allclose(partial.full_tensor(), values.unfold(2, 2, 1))}
    return results


def test_unfold_and_its_gradient_match_plain_tensors():
    for rank, results in enumerate(run_on_ranks(unfold_on_rank, world_size=2)):
        for name, checks in results.items():
            assert all(checks.values()), (rank, name, checks)
