"""Which stages a rank holds and which ``torch.distributed.pipelining`` schedule runs them.

Every schedule is PyTorch's own; dpipe only places stages on ranks the way each schedule
expects (round-robin for the looped schedules, a V for ZBV) and turns off PyTorch's
gradient scaling, because dpipe scales each parameter once per rank itself (a tied
parameter can sit in two stages of one rank).

Example::

    assert local_stage_indices(PipelinePlan(size=2, schedule="zbv", virtual_stages=2), pp_rank=0) == [0, 3]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from vescale.dpipe.plan import PipelinePlan

__all__ = ["build_schedule", "local_stage_indices"]

_SINGLE_STAGE: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_MULTI_STAGE: dict[str, type[PipelineScheduleMulti]] = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def local_stage_indices(plan: PipelinePlan, pp_rank: int) -> list[int]:
    """The stage indices rank ``pp_rank`` of the ``pp`` dimension runs, in ascending order.

    Example::

        plan = PipelinePlan(size=2, schedule="interleaved_1f1b", virtual_stages=2)
        assert local_stage_indices(plan, pp_rank=1) == [1, 3]
    """
    if plan.schedule == "zbv":
        return [pp_rank, 2 * plan.size - 1 - pp_rank]
    return [pp_rank + round_index * plan.size for round_index in range(plan.virtual_stages)]


def build_schedule(
    plan: PipelinePlan, stages: list[PipelineStage], loss_fn: Callable[..., Any] | None
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """PyTorch's schedule named by ``plan.schedule`` over this rank's ``stages``.

    Example::

        schedule = build_schedule(plan, [stage], loss_fn=lambda output, target: output[0])
        schedule.step(input_ids=input_ids, target=target)
    """
    if plan.schedule in _SINGLE_STAGE:
        return _SINGLE_STAGE[plan.schedule](
            stages[0], plan.microbatch_count, loss_fn=loss_fn, scale_grads=False
        )
    # torch types the stage list as list[_PipelineStageBase] (invariant); it only reads it.
    return _MULTI_STAGE[plan.schedule](
        list(stages), plan.microbatch_count, loss_fn=loss_fn, scale_grads=False
    )
