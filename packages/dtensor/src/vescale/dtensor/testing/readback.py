"""One rank's side of a data-parallel correctness test: the first step's gradients and the losses.

A parallel optimizer's gradients are read back from what it stepped (one plain SGD step on a
fresh model, :func:`~vescale.dtensor.testing.numerics.sgd_step_gradients`), and a second fresh
model trains for a few steps under the optimizer under test; each rank's loss is the mean over
its equal share of the global batch, so the global loss is their mean over the ranks. Both are
compared with :func:`~vescale.dtensor.testing.reference.train_reference`'s.

Example::

    def run() -> dict:   # on each rank, through run_on_ranks(run, 2)
        return sgd_gradients_and_mean_losses(build, local_batches, loss_fn, adamw, sgd_lr=1e3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vescale.dtensor.testing.numerics import full_parameters, sgd_step_gradients
from vescale.dtensor.testing.reference import train_steps

__all__ = ["sgd_gradients_and_mean_losses"]

OptimizerFn = Callable[[nn.Module], torch.optim.Optimizer]


def sgd_gradients_and_mean_losses(
    build: Callable[[OptimizerFn], tuple[nn.Module, torch.optim.Optimizer]],
    local_batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer_fn: OptimizerFn,
    sgd_lr: float,
) -> dict[str, Any]:
    """``{"gradients": {fqn: first-step gradient}, "losses": [global loss per step]}`` of this rank.

    ``build(optimizer_fn)`` makes a fresh parallel model (the same seed each call) and its
    optimizer. The gradients come from one SGD step at ``sgd_lr`` on ``local_batches[0]``, the
    losses from ``len(local_batches)`` steps under ``optimizer_fn``, averaged over every rank of
    the default process group. Call it on every rank.

    Example::

        run = sgd_gradients_and_mean_losses(build, [local(batch) for batch in batches], mse, adamw, 1e3)
    """
    model, optimizer = build(lambda module: torch.optim.SGD(module.parameters(), lr=sgd_lr))
    before = full_parameters(model)
    train_steps(model, optimizer, local_batches[:1], loss_fn)
    gradients = sgd_step_gradients(before, full_parameters(model), sgd_lr)
    model, optimizer = build(optimizer_fn)
    totals = torch.tensor(train_steps(model, optimizer, local_batches, loss_fn))
    dist.all_reduce(totals)
    return {"gradients": gradients, "losses": (totals / dist.get_world_size()).tolist()}
