"""``clip_grad_norm_`` over a mesh with a ``pp`` dim: each stage's gradients counted, tied copies once.

Two hand-made "stages" on a pp2 x dp2 mesh: pp rank ``s`` holds its own ``Linear`` (seeded by
``s``) and a tied ``Linear`` that both stages hold, whose gradient is the same constant ``K`` on
every rank (as after a pipeline's sum of the tied copies). Stage 1 marks its tied copy with
``mark_pipeline_copy``. Reference, one process: each stage's own gradient averaged over the two
dp ranks' inputs, plus the tied gradient once; its 2-norm. The returned norm is compared on
every rank, and the gradients are checked scaled by the clip coefficient. Counting stage 0 only
(the rule before pp was known) gave 4.07 against 5.02, the tied copy twice 5.24; float32 rounding
moves it by ~1e-7.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vescale.doptim import DistributedOptimizer, clip_grad_norm_, data_parallel
from vescale.doptim.clip import mark_pipeline_copy
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

MAX_NORM = 0.5
TIED_GRADIENT = 0.75
BOUND = 1e-6


def _own_layer(stage: int) -> nn.Linear:
    torch.manual_seed(stage)
    return nn.Linear(4, 3)


def _inputs(stage: int, dp_rank: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * stage + dp_rank))


def _tied_loss(tied: nn.Linear) -> torch.Tensor:
    return TIED_GRADIENT * (tied.weight.sum() + tied.bias.sum())


def clip_on_rank(zero_stage: int) -> tuple[float, list[torch.Tensor]]:
    mesh = init_mesh(pp=2, dp=2)
    stage, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = nn.ModuleDict({"own": _own_layer(stage), "tied": nn.Linear(3, 1)})
    if stage == 1:
        for parameter in model["tied"].parameters():
            mark_pipeline_copy(parameter)
    data_parallel(model, mesh, zero_stage=zero_stage, bucket_size_mb=1e-4)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    (model["own"](_inputs(stage, dp_rank)).square().sum() + _tied_loss(model["tied"])).backward()
    norm = clip_grad_norm_(optimizer, MAX_NORM)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    optimizer.step()
    dist.barrier()
    return float(norm), [b - a.detach() for b, a in zip(before, model.parameters(), strict=True)]


def _reference() -> tuple[float, dict[int, list[torch.Tensor]]]:
    """The single-device norm, and each stage's gradients (own, then tied) before clipping."""
    gradients = {}
    for stage in (0, 1):
        own = _own_layer(stage)
        for dp_rank in (0, 1):
            (own(_inputs(stage, dp_rank)).square().sum() / 2).backward()
        tied = nn.Linear(3, 1)
        _tied_loss(tied).backward()
        gradients[stage] = [own.weight.grad, own.bias.grad, tied.weight.grad, tied.bias.grad]
    counted = [*gradients[0], *gradients[1][:2]]
    return float(torch.stack([grad.norm() for grad in counted]).norm()), gradients


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_each_stage_counts_its_own_gradients_and_a_tied_copy_once(zero_stage):
    norm, gradients = _reference()
    coefficient = min(1.0, MAX_NORM / (norm + 1e-6))
    for rank, (rank_norm, updates) in enumerate(run_on_ranks(clip_on_rank, world_size=4, args=(zero_stage,))):
        assert abs(rank_norm - norm) <= BOUND * norm, (rank, rank_norm, norm)
        for update, gradient in zip(updates, gradients[rank // 2], strict=True):
            torch.testing.assert_close(update, gradient * coefficient, rtol=1e-5, atol=1e-7)
