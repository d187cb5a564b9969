"""The training recipe shared by every rank and by the single-device reference.

Both sides must build the same optimizer and learning-rate schedule and see the same global
batches, so that ``--compare-single-device`` compares parallelism alone.

Example::

    optimizer = make_optimizer(model, learning_rate=3e-3)
    scheduler = make_lr_scheduler(optimizer)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "DEFAULT_GLOBAL_BATCH_SIZE",
    "DEFAULT_LEARNING_RATE",
    "DEFAULT_SEQUENCE_LENGTH",
    "WARMUP_STEPS",
    "default_constraints",
    "make_lr_scheduler",
    "make_optimizer",
    "split_deterministic",
]

DETERMINISTIC_KEY = "data_parallel.deterministic"

DEFAULT_GLOBAL_BATCH_SIZE = 32
DEFAULT_SEQUENCE_LENGTH = 128
DEFAULT_LEARNING_RATE = 3e-3
WARMUP_STEPS = 10


def default_constraints(user_constraints: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The user's constraints (flat dotted keys) over the run's defaults: batch, sequence, micro-batch.

    Without a ``micro_batch_size`` the planner uses 1 and accumulates gradients sample by sample;
    one micro-batch of a data-parallel rank's whole share is the faster default. The share assumes
    the data-parallel size left after the tensor and pipeline sizes the user fixed.

    Example::

        default_constraints({"tensor_parallel.size": 2}, world_size=4)   # micro_batch_size 8
    """
    from vescale.planner import Constraints

    given = Constraints.from_dict(user_constraints).to_dict()
    constraints: dict[str, Any] = {
        "global_batch_size": DEFAULT_GLOBAL_BATCH_SIZE,
        "sequence_length": DEFAULT_SEQUENCE_LENGTH,
        **given,
    }
    if "micro_batch_size" in given or "pipeline_parallel.num_microbatches" in given:
        return constraints
    model_parallel = given.get("tensor_parallel.size", 1) * given.get("pipeline_parallel.size", 1)
    data_parallel = given.get("data_parallel.size", max(1, world_size // model_parallel))
    share, rest = divmod(
        constraints["global_batch_size"], data_parallel * given.get("pipeline_parallel.size", 1)
    )
    if share >= 1 and rest == 0:
        constraints["micro_batch_size"] = share
    return constraints


def split_deterministic(user_constraints: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The constraints without ``data_parallel.deterministic`` when the planner does not take that key,
    and whether it asked for rank-ordered data-parallel sums (the run then sets the plan's field).

    Example::

        split_deterministic({"data_parallel.deterministic": True})   # ({}, True) on such a planner
    """
    from vescale.planner import Constraints, PlanError

    wanted = bool(user_constraints.get(DETERMINISTIC_KEY, False))
    try:
        Constraints.from_dict({DETERMINISTIC_KEY: True})
    except PlanError:
        return {key: value for key, value in user_constraints.items() if key != DETERMINISTIC_KEY}, wanted
    return dict(user_constraints), wanted


def make_optimizer(model: nn.Module, learning_rate: float = DEFAULT_LEARNING_RATE) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters (weight decay off: the comparison stays about parallelism).

    Example::

        optimizer = make_optimizer(model)
    """
    return torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0)


def _warmup_factor(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP_STEPS)


def make_lr_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over :data:`WARMUP_STEPS` steps, then constant: a resumed run continues unchanged.

    Example::

        scheduler = make_lr_scheduler(optimizer)
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_factor)
