"""PipelinePlan: JSON round trip, defaults and the errors for inconsistent fields."""

from __future__ import annotations

import json

import pytest

from vescale.dpipe import SCHEDULES, PipelinePlan, PipelinePlanError


def test_plan_round_trips_through_json_exactly():
    plan = PipelinePlan(
        size=2,
        split_method="manual",
        split_points=("model.layers.2", "model.layers.4", "model.layers.6"),
        schedule="interleaved_1f1b",
        num_microbatches=8,
        virtual_stages=2,
    )
    text = json.dumps(plan.to_dict())
    assert PipelinePlan.from_dict(json.loads(text)) == plan
    assert json.loads(text)["split_points"] == ["model.layers.2", "model.layers.4", "model.layers.6"]


def test_default_plan_has_one_microbatch_per_stage():
    assert PipelinePlan(size=4).num_microbatches == 4
    assert PipelinePlan(size=2, schedule="zbv", virtual_stages=2).num_microbatches == 4


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_accepts_its_default_plan(schedule: str):
    virtual_stages = 1 if schedule in ("gpipe", "1f1b") else 2
    assert (
        PipelinePlan(size=2, schedule=schedule, virtual_stages=virtual_stages).num_stages
        == 2 * virtual_stages
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(size=0), r"PipelinePlan\.size must be a positive integer, got 0"),
        (dict(size=2, schedule="dualpipe"), r"schedule 'dualpipe' is unknown; choose one of"),
        (dict(size=2, split_method="even"), r"split_method 'even' is unknown"),
        (dict(size=2, split_method="manual"), r"needs 1 split points, got 0"),
        (dict(size=2, split_points=("model.layers.1",)), r"set split_method='manual'"),
        (dict(size=2, virtual_stages=2), r"schedule '1f1b' runs one stage per rank.*virtual_stages is 2"),
        (dict(size=2, schedule="zbv", virtual_stages=3), r"'zbv' places exactly 2 stages per rank"),
        (dict(size=4, num_microbatches=2), r"'1f1b' needs at least as many micro-batches as stages"),
        (
            dict(size=2, schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=5),
            r"multiple of the number of rounds \(2\)",
        ),
    ],
)
def test_inconsistent_plans_are_refused_with_the_fix(fields: dict, message: str):
    with pytest.raises(PipelinePlanError, match=message):
        PipelinePlan(**fields)


def test_from_dict_refuses_unknown_fields():
    with pytest.raises(PipelinePlanError, match=r"unknown PipelinePlan field\(s\) \['microbatches'\]"):
        PipelinePlan.from_dict({"size": 2, "microbatches": 4})
    with pytest.raises(PipelinePlanError, match=r"needs 'size'"):
        PipelinePlan.from_dict({})
