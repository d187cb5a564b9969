"""DataParallelPlan: the doptim section of a veScale plan, its checks and its JSON round trip."""

import json

import pytest

from vescale.doptim.errors import DataParallelConfigError, DOptimError
from vescale.doptim.plan import DataParallelPlan


def test_data_parallel_plan_round_trips_through_json_exactly():
    plans = [
        DataParallelPlan(size=1),
        DataParallelPlan(
            size=4, zero_stage=2, bucket_size_mb=12.5, deterministic=True, mixed_precision="bf16"
        ),
        DataParallelPlan(size=8, zero_stage=3),
    ]
    for plan in plans:
        assert DataParallelPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_data_parallel_plan_accepts_an_integer_bucket_size_from_edited_json():
    plan = DataParallelPlan.from_dict(json.loads('{"size": 2, "bucket_size_mb": 50}'))
    assert plan.bucket_size_mb == 50.0 and isinstance(plan.bucket_size_mb, float)
    assert plan.to_dict() == {
        "size": 2,
        "zero_stage": 0,
        "bucket_size_mb": 50.0,
        "deterministic": False,
        "mixed_precision": "fp32",
    }


def test_data_parallel_plan_sharding_flags_follow_the_zero_stage():
    flags = [
        (p.shards_optimizer_state, p.shards_gradients, p.shards_parameters)
        for p in (DataParallelPlan(size=2, zero_stage=stage) for stage in range(4))
    ]
    assert flags == [
        (False, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"size": 0}, "DataParallelPlan.size must be a positive integer, got 0"),
        ({"size": True}, "DataParallelPlan.size must be a positive integer, got True"),
        ({"size": 2, "zero_stage": 4}, r"zero_stage must be one of \(0, 1, 2, 3\), got 4"),
        ({"size": 2, "bucket_size_mb": 0}, "bucket_size_mb must be a positive number of MiB, got 0"),
        ({"size": 2, "deterministic": "yes"}, "deterministic must be true or false, got 'yes'"),
        ({"size": 2, "mixed_precision": "fp16"}, r"mixed_precision 'fp16' is unknown; choose one of"),
        ({"size": 2, "zero_stage": 3, "bucket_size_mb": 50}, "which has no gradient buckets"),
    ],
)
def test_data_parallel_plan_refuses_bad_fields_naming_them(fields, message):
    with pytest.raises(DataParallelConfigError, match=message) as error:
        DataParallelPlan(**fields)
    assert isinstance(error.value, DOptimError) and isinstance(error.value, ValueError)


def test_data_parallel_plan_from_dict_refuses_unknown_and_missing_keys():
    with pytest.raises(DataParallelConfigError, match=r"unknown DataParallelPlan field\(s\) \['zero'\]"):
        DataParallelPlan.from_dict({"size": 2, "zero": 1})
    with pytest.raises(DataParallelConfigError, match="needs 'size'"):
        DataParallelPlan.from_dict({"zero_stage": 1})
    with pytest.raises(DataParallelConfigError, match="is a dict like"):
        DataParallelPlan.from_dict([2, 1])


def test_data_parallel_plan_takes_deterministic_zero3():
    assert DataParallelPlan(size=2, zero_stage=3, deterministic=True).shards_parameters
