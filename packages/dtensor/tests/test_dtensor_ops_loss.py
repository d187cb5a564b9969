"""Cross-entropy on vocabulary-sharded logits, against ``F.cross_entropy`` in one process.

The loss and the logits' gradient are compared within 1e-6 relative: the sharded softmax
sums exponentials per rank and then across ranks, a different order of float32 additions
over at most 66 terms. Communication is checked exactly with ``CommCounter``: in the forward
one all-gather of two per-token values from each rank (its slice's maximum and sum of
exponentials) and one all-reduce of the picked log-probabilities, none in the backward, and no
all-gather of the logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

import vescale.dtensor.ops  # noqa: F401  (registers the handlers)
from vescale.dtensor.comm import CommCounter
from vescale.dtensor.testing import run_on_ranks

RTOL = 1e-6
TOKENS = 12


def _inputs(num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(TOKENS, num_classes, generator=generator) * 3
    target = torch.randint(0, num_classes, (TOKENS,), generator=generator)
    target[[2, 7]] = -100
    return logits, target


def _reference(num_classes: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    logits, target = _inputs(num_classes)
    logits.requires_grad_(True)
    loss = F.cross_entropy(logits, target, ignore_index=-100, reduction=reduction)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), logits.grad


def _traffic(counter: CommCounter) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(phase, collective): (calls, elements)}`` of what a counter saw."""
    traffic: dict[tuple[str, str], tuple[int, int]] = {}
    for call in counter.calls:
        calls, elements = traffic.get((call.phase, call.collective), (0, 0))
        traffic[(call.phase, call.collective)] = (calls + 1, elements + call.numel)
    return traffic


def _vescale_cross_entropy(mesh, num_classes: int, reduction: str):
    logits, target = _inputs(num_classes)
    sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_(True)
    target = distribute_tensor(target, mesh, [Replicate()])
    with CommCounter(mesh) as counter:
        loss = F.cross_entropy(sharded, target, ignore_index=-100, reduction=reduction)
        loss.backward(torch.ones_like(loss))
    return loss.full_tensor(), sharded.grad.placements, sharded.grad.full_tensor(), _traffic(counter)


def sharded_cross_entropy_on_ranks(num_classes: int, reduction: str):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return _vescale_cross_entropy(mesh, num_classes, reduction)


def _expected_traffic(world_size: int) -> dict[tuple[str, str], tuple[int, int]]:
    """Per token: each rank's softmax maximum and sum of exponentials (one all-gather, counted
    by its output), the picked log-probability (one all-reduce). Before the all-gather: three
    all-reduces (maximum, sum, picked) of TOKENS values each."""
    return {("forward", "all_gather"): (1, 2 * TOKENS * world_size), ("forward", "all_reduce"): (1, TOKENS)}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("world_size", "num_classes"), [(2, 64), (4, 66)], ids=["even", "uneven"])
def test_vocab_sharded_cross_entropy_matches_single_process_without_gathering(
    world_size: int, num_classes: int, reduction: str
):
    expected_loss, expected_grad = _reference(num_classes, reduction)
    loss, grad_placements, grad, traffic = run_on_ranks(
        sharded_cross_entropy_on_ranks, world_size, args=(num_classes, reduction)
    )[0]
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=0)
    assert (grad - expected_grad).abs().max() <= RTOL * expected_grad.abs().max()
    assert grad_placements == (Shard(1),)
    # Before the backward reused nll_loss_backward's row sums it also all-reduced TOKENS values.
    assert traffic == _expected_traffic(world_size), traffic


def after_loss_parallel_on_ranks(num_classes: int):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    logits, target = _inputs(num_classes)
    sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_(True)
    with loss_parallel():  # PyTorch's handlers over veScale's, deleted again on exit
        torch_loss = F.cross_entropy(sharded, distribute_tensor(target, mesh, [Replicate()]))
        torch_loss.backward()
    return (
        torch_loss.full_tensor(),
        sharded.grad.full_tensor(),
        _vescale_cross_entropy(mesh, num_classes, "mean"),
    )


def test_vocab_parallel_cross_entropy_still_applies_after_torch_loss_parallel():
    expected_loss, expected_grad = _reference(64, "mean")
    torch_loss, torch_grad, (loss, grad_placements, grad, traffic) = run_on_ranks(
        after_loss_parallel_on_ranks, 2, args=(64,)
    )[0]
    torch.testing.assert_close(torch_loss, expected_loss, rtol=RTOL, atol=0)
    assert (torch_grad - expected_grad).abs().max() <= RTOL * expected_grad.abs().max()
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=0)
    assert (grad - expected_grad).abs().max() <= RTOL * expected_grad.abs().max()
    assert grad_placements == (Shard(1),)
    # Without veScale's handlers DTensor would all-gather the logits instead.
    assert traffic == _expected_traffic(2), traffic


def log_probs_used_twice_on_ranks():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    logits, target = _inputs(64)
    sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_(True)
    with CommCounter(mesh) as counter:
        log_probs = F.log_softmax(sharded, dim=-1)
        loss = F.nll_loss(log_probs, distribute_tensor(target, mesh, [Replicate()])) + log_probs.mean()
        loss.backward()
    return loss.full_tensor(), sharded.grad.full_tensor(), _traffic(counter)


def test_softmax_backward_reduces_a_gradient_that_is_not_nll_loss_backwards_alone():
    logits, target = _inputs(64)
    logits.requires_grad_(True)
    log_probs = F.log_softmax(logits, dim=-1)
    expected_loss = F.nll_loss(log_probs, target) + log_probs.mean()
    expected_loss.backward()
    loss, grad, traffic = run_on_ranks(log_probs_used_twice_on_ranks, 2)[0]
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=RTOL, atol=0)
    assert (grad - logits.grad).abs().max() <= RTOL * logits.grad.abs().max()
    # The summed gradient's row sums are unknown: the softmax backward all-reduces them.
    assert traffic[("backward", "all_reduce")] == (1, TOKENS), traffic


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
