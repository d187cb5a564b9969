"""Cross-entropy on vocabulary-sharded logits, against ``F.cross_entropy`` in one process.

The loss and the logits' gradient are compared within 1e-6 relative: the sharded softmax
sums exponentials per rank and then across ranks, a different order of float32 additions
over at most 66 terms. Communication is checked exactly: all-reduces of per-token values,
and no all-gather of the logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import vescale.dtensor.ops  # noqa: F401  (registers the handlers)
from vescale.dtensor.testing import run_on_ranks

RTOL = 1e-6


def _inputs(num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(12, num_classes, generator=generator) * 3
    target = torch.randint(0, num_classes, (12,), generator=generator)
    target[[2, 7]] = -100
    return logits, target


def _reference(num_classes: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    logits, target = _inputs(num_classes)
    logits.requires_grad_(True)
    loss = F.cross_entropy(logits, target, ignore_index=-100, reduction=reduction)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), logits.grad


def sharded_cross_entropy_on_ranks(num_classes: int, reduction: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    logits, target = _inputs(num_classes)
    sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_(True)
    target = distribute_tensor(target, mesh, [Replicate()])
    with CommDebugMode() as comm:
        loss = F.cross_entropy(sharded, target, ignore_index=-100, reduction=reduction)
        loss.backward(torch.ones_like(loss))
    counts = {str(op): count for op, count in comm.get_comm_counts().items()}
    return loss.full_tensor(), sharded.grad.placements, sharded.grad.full_tensor(), counts


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("world_size", "num_classes"), [(2, 64), (4, 66)], ids=["even", "uneven"])
def test_vocab_sharded_cross_entropy_matches_single_process_without_gathering(
    world_size: int, num_classes: int, reduction: str
):
    expected_loss, expected_grad = _reference(num_classes, reduction)
    loss, grad_placements, grad, counts = run_on_ranks(
        sharded_cross_entropy_on_ranks, world_size, args=(num_classes, reduction)
    )[0]
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=0)
    assert (grad - expected_grad).abs().max() <= RTOL * expected_grad.abs().max()
    assert grad_placements == (Shard(1),)
    assert not any("all_gather" in op for op in counts), counts
    # max and sum of the softmax, the picked log-probabilities, the backward's sum: all per token.
    assert sum(count for op, count in counts.items() if "allreduce" in op or "all_reduce" in op) == 4, counts


def replicated_logits_fall_back_on_ranks():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    logits, target = _inputs(64)
    replicated = distribute_tensor(logits, mesh, [Replicate()]).requires_grad_(True)
    loss = F.cross_entropy(replicated, distribute_tensor(target, mesh, [Replicate()]))
    loss.backward()
    return isinstance(loss, DTensor), loss.full_tensor(), replicated.grad.full_tensor()


def test_unsharded_class_dim_goes_to_dtensors_own_dispatch():
    expected_loss, expected_grad = _reference(64, "mean")
    is_dtensor, loss, grad = run_on_ranks(replicated_logits_fall_back_on_ranks, 2)[0]
    assert is_dtensor
    # Replicate computes exactly the single-process arithmetic.
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
