"""Plan: exact JSON round trip, hand-edited plans accepted, bad ones refused naming the field, the table."""

from __future__ import annotations

import json

import pytest

from vescale.dmodule import plan_tensor_parallel
from vescale.doptim.plan import DataParallelPlan
from vescale.dpipe.plan import PipelinePlan
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model
from vescale.planner import MemoryEstimate, Plan, PlanError, PlanFormatError, generate_plan
from vescale.planner.performance import Performance, RunnerUp


@pytest.fixture(scope="module")
def llama():
    return build_tiny_hf_model("llama")


@pytest.fixture(scope="module")
def tp_plan(llama):
    return generate_plan(
        llama,
        {"tensor_parallel.size": 2, "zero.stage": 1, "global_batch_size": 8, "sequence_length": 8},
        world_size=4,
    )


def test_generated_plans_round_trip_through_json_exactly(llama, tp_plan):
    pipeline = generate_plan(
        llama,
        {
            "pipeline_parallel.size": 2,
            "global_batch_size": 4,
            "sequence_length": 8,
            "mixed_precision": "bf16",
        },
        world_size=2,
    )
    for plan in (tp_plan, pipeline, generate_plan(llama, {"sequence_length": 8}, world_size=1)):
        text = plan.to_json()
        assert Plan.from_json(text) == plan
        assert Plan.from_json(text).to_json() == text


def test_a_hand_built_plan_orders_the_mesh_canonically_and_derives_micro_batches():
    plan = Plan(
        mesh=(("tp", 1), ("dp", 2), ("pp", 2)),
        data_parallel=DataParallelPlan(size=2),
        global_batch_size=16,
        micro_batch_size=2,
        pipeline=PipelinePlan(size=2, num_microbatches=4),
    )
    assert plan.mesh == (("pp", 2), ("dp", 2), ("ep", 1), ("tp", 1))
    assert (plan.world_size, plan.num_microbatches, plan.mixed_precision) == (4, 4, "fp32")
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_an_edited_json_plan_is_accepted(tp_plan):
    edited = json.loads(tp_plan.to_json())
    edited["data_parallel"]["zero_stage"] = 2
    edited["micro_batching"]["global_batch_size"] = 16
    edited["tensor_parallel"]["sequence_parallel"] = False
    plan = Plan.from_json(json.dumps(edited))
    assert (plan.data_parallel.zero_stage, plan.num_microbatches, plan.sequence_parallel) == (2, 8, False)
    # Without tensor parallelism: tp=1, the sharding plan dropped, dp takes the ranks.
    edited.update(mesh={"dp": 4}, tensor_parallel={"sequence_parallel": False, "sharding_plan": None})
    edited["data_parallel"]["size"] = 4
    plan = Plan.from_json(json.dumps(edited))
    assert plan.mesh == (("pp", 1), ("dp", 4), ("ep", 1), ("tp", 1)) and plan.sharding_plan is None


def _edit(plan: Plan, path: str, value) -> str:
    plan_dict = json.loads(plan.to_json())
    *parents, key = path.split(".")
    node = plan_dict
    for parent in parents:
        node = node[parent]
    if value is _DELETE:
        del node[key]
    else:
        node[key] = value
    return json.dumps(plan_dict)


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("data_paralel", {"size": 2}, r"unknown plan field 'data_paralel'; did you mean 'data_parallel'\?"),
        ("mesh.cp", 2, r"plan field mesh has unknown dimension\(s\) \['cp'\]"),
        ("mesh.tp", 0, "plan field mesh.tp must be a positive integer, got 0"),
        ("mesh.ep", 3, r"global_batch_size=8 does not split into dp=2 x ep=3 ranks"),
        ("mesh.dp", 4, "plan field data_parallel.size=2 differs from mesh.dp=4"),
        (
            "data_parallel.zero_stage",
            5,
            r"plan field data_parallel: DataParallelPlan.zero_stage must be one of",
        ),
        (
            "data_parallel.zero",
            1,
            r"plan field data_parallel: unknown DataParallelPlan field\(s\) \['zero'\]",
        ),
        (
            "tensor_parallel.sharding_plan",
            None,
            "plan field tensor_parallel.sharding_plan is missing but mesh.tp=2",
        ),
        (
            "tensor_parallel.sharding_plan",
            {"params": {}},
            "plan field tensor_parallel.sharding_plan: unknown plan key",
        ),
        ("tensor_parallel.sequence_parallel", "yes", "plan field tensor_parallel.sequence_parallel='yes'"),
        ("tensor_parallel.sp", True, r"unknown plan field 'tensor_parallel.sp'"),
        ("micro_batching.global_batch_size", 7, "global_batch_size=7 does not split into dp=2 ranks"),
        ("micro_batching.micro_batch_size", -1, "micro_batching.micro_batch_size must be a positive integer"),
        (
            "micro_batching.global_batch_size",
            _DELETE,
            "plan field 'micro_batching.global_batch_size' is missing",
        ),
        (
            "pipeline_parallel",
            {"size": 2},
            "plan field pipeline_parallel must be given exactly when mesh.pp > 1",
        ),
        ("activation_checkpointing", "some", "plan field activation_checkpointing='some' is not one of"),
        ("memory.memory_per_device_gb", -1, "memory.memory_per_device_gb must be a positive number"),
        ("memory.estimate", {"parameters": 1}, "plan field memory.estimate: memory_estimate must be a dict"),
        ("format", "vescale.plan/9", "plan field format='vescale.plan/9'"),
        ("reasons", ["why"], "plan field reasons must be a JSON object"),
    ],
)
def test_a_bad_json_plan_is_refused_naming_the_field(tp_plan, path, value, message):
    with pytest.raises(PlanFormatError, match=message) as error:
        Plan.from_json(_edit(tp_plan, path, value))
    assert isinstance(error.value, PlanError) and isinstance(error.value, ValueError)


def test_a_pipeline_section_must_agree_with_the_micro_batches(llama):
    with pytest.raises(PlanFormatError, match=r"pipeline_parallel.num_microbatches=2, but .* = 4"):
        Plan(
            mesh={"pp": 2},
            data_parallel=DataParallelPlan(size=1),
            global_batch_size=4,
            pipeline=PipelinePlan(size=2, num_microbatches=2),
        )
    with pytest.raises(PlanFormatError, match="the plan is not valid JSON"):
        Plan.from_json("{mesh")
    sharding_plan = plan_tensor_parallel(llama).plan
    with pytest.raises(PlanFormatError, match=r"sharding_plan is given but mesh\.tp=1 has nothing to shard"):
        Plan(
            mesh={}, data_parallel=DataParallelPlan(size=1), global_batch_size=1, sharding_plan=sharding_plan
        )


def test_print_shows_the_choices_and_the_memory_per_device(tp_plan):
    text = str(tp_plan)
    expected_rows = [
        "mesh                      pp=1  dp=2  ep=1  tp=2",
        "tensor parallel           2 (",
        "sequence parallel         on",
        "pipeline parallel         off",
        "data parallel             2, ZeRO-1",
        "micro-batches per step    4 (gradient accumulation)",
        "memory per device (estimate)",
        "optimizer states",
    ]
    for row in expected_rows:
        assert row in text, f"{row!r} missing from:\n{text}"
    total = tp_plan.memory_estimate.total / 2**30
    assert "total" in text and f"{total:.2f} GiB of {tp_plan.memory_per_device_gb:.2f} GiB" in text


def test_explain_gives_a_reason_for_each_choice(tp_plan):
    reasons = dict(tp_plan.reasons)
    assert reasons["tensor_parallel"] == "constraint" and reasons["zero_stage"] == "constraint"
    assert reasons["sequence_parallel"].startswith("on with tensor parallelism")
    assert reasons["data_parallel"] == "the rest of the world: 2 = world / (tp x pp)"
    explained = tp_plan.explain()
    assert all(choice in explained for choice in reasons)


def test_memory_estimate_of_a_plan_is_what_estimate_memory_says(llama, tp_plan):
    from vescale.planner import estimate_memory

    assert isinstance(tp_plan.memory_estimate, MemoryEstimate)
    assert estimate_memory(llama, tp_plan) == tp_plan.memory_estimate


def test_a_plan_with_predicted_performance_round_trips_prints_and_explains_its_runners_up():
    runner_up = RunnerUp(
        "pp1 dp2 tp1 zero3 fp32 mbs1 ac=none", 2.5, {"compute": 2.0, "dp": 0.5}, "25% slower"
    )
    performance = Performance("h100-80gb", 2.0, 4096.0, 300.0, 0.3, {"compute": 1.8, "tp": 0.2}, (runner_up,))
    plan = Plan(
        mesh={"dp": 2},
        data_parallel=DataParallelPlan(size=2),
        global_batch_size=2,
        performance=performance,
        reasons=(("data_parallel", "fastest"),),
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.to_dict()["performance"]["breakdown"] == {"compute": 1.8, "tp": 0.2}
    assert "MFU" in str(plan) and "30.0%" in str(plan)
    assert "pp1 dp2 tp1 zero3 fp32 mbs1 ac=none: 2.5 s (25% slower)" in plan.explain()
    with pytest.raises(PlanFormatError, match="performance"):
        Plan.from_dict({**plan.to_dict(), "performance": {"hardware": "h100-80gb"}})
