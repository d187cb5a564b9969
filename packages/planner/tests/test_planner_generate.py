"""generate_plan: Megatron's rules on the memory estimate, constraints that win, impossible ones refused."""

from __future__ import annotations

import time

import pytest

from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.meta_llama import meta_llama
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model
from vescale.planner import ConstraintError, ParallelChoices, estimate_memory, generate_plan

_GIB = 2**30


@pytest.fixture(scope="module")
def llama():
    return build_tiny_hf_model("llama")


def _smallest_without_model_parallelism(model, world_size: int) -> int:
    """Bytes per device of the leanest data-parallel-only run, over every ZeRO stage and checkpointing.

    Not always ZeRO-3: on a tiny model FSDP2's unsharded root and blocks outweigh what it shards.
    """
    return min(
        estimate_memory(
            model,
            ParallelChoices(
                data_parallel_size=world_size,
                zero_stage=zero_stage,
                activation_checkpointing=checkpointing,
                sequence_length=8,
            ),
        ).total
        for zero_stage in (0, 1, 2, 3)
        for checkpointing in ("none", "selective", "full")
    )


def test_with_room_to_spare_the_plan_is_plain_data_parallel(llama):
    plan = generate_plan(llama, {"sequence_length": 8, "memory_per_device_gb": 1.0}, world_size=4)
    assert plan.mesh == (("pp", 1), ("dp", 4), ("ep", 1), ("tp", 1))
    assert (plan.data_parallel.zero_stage, plan.activation_checkpointing, plan.sequence_parallel) == (
        0,
        "none",
        False,
    )
    assert plan.sharding_plan is None and plan.pipeline is None
    assert plan.memory_estimate.total <= 1.0 * _GIB


def test_when_data_parallel_alone_does_not_fit_tensor_parallel_comes_first_within_a_node(llama):
    budget_gb = (_smallest_without_model_parallelism(llama, 4) - 1) / _GIB
    plan = generate_plan(llama, {"sequence_length": 8, "memory_per_device_gb": budget_gb}, world_size=4)
    assert (plan.mesh_size("tp"), plan.mesh_size("pp"), plan.mesh_size("dp")) == (2, 1, 2)
    assert plan.sequence_parallel and plan.sharding_plan is not None
    assert plan.memory_estimate.total <= budget_gb * _GIB
    assert "smallest model-parallel size (tp x pp = 2)" in dict(plan.reasons)["tensor_parallel"]


def test_with_one_device_per_node_the_model_is_split_by_pipeline_across_nodes(llama):
    budget_gb = (_smallest_without_model_parallelism(llama, 2) - 1) / _GIB
    # One micro-batch per step: a pipeline's first stage then holds no more activations than dp does.
    constraints = {
        "sequence_length": 8,
        "memory_per_device_gb": budget_gb,
        "devices_per_node": 1,
        "pipeline_parallel.num_microbatches": 1,
    }
    plan = generate_plan(llama, constraints, world_size=2)
    assert (plan.mesh_size("tp"), plan.mesh_size("pp"), plan.mesh_size("dp")) == (1, 2, 1)
    assert plan.pipeline.size == 2 and plan.memory_estimate.total <= budget_gb * _GIB


def test_constraints_always_win(llama):
    constraints = {
        "tensor_parallel.size": 2,
        "data_parallel.size": 2,
        "zero.stage": 2,
        "sequence_parallel": False,
        "mixed_precision": "bf16",
        "activation_checkpointing": "full",
        "global_batch_size": 16,
        "micro_batch_size": 2,
        "sequence_length": 8,
    }
    plan = generate_plan(llama, constraints, world_size=4)
    assert plan.mesh == (("pp", 1), ("dp", 2), ("ep", 1), ("tp", 2))
    assert (plan.data_parallel.zero_stage, plan.sequence_parallel, plan.mixed_precision) == (2, False, "bf16")
    assert (plan.activation_checkpointing, plan.global_batch_size, plan.micro_batch_size) == ("full", 16, 2)
    assert plan.num_microbatches == 4 and dict(plan.reasons)["zero_stage"] == "constraint"


@pytest.mark.parametrize(
    ("constraints", "world_size", "message"),
    [
        ({"tensor_parallel.size": 3}, 4, "tensor_parallel.size=3 = 3 does not divide the world size 4"),
        (
            {"tensor_parallel.size": 2, "data_parallel.size": 2, "pipeline_parallel.size": 2},
            4,
            "= 8 devices, but the world size is 4",
        ),
        (
            {"tensor_parallel.size": 16, "devices_per_node": 16, "memory_per_device_gb": 1.0},
            16,
            r"tensor_parallel.size=16 does not divide the attention head count\(s\) \[8\] \(larger than",
        ),
        ({"memory_per_device_gb": 1e-6}, 2, "no plan fits memory_per_device_gb=0.00"),
        ({}, 1024, "planning for 1024 devices, but this machine has .*hardware profile"),
        (
            {"global_batch_size": 3, "tensor_parallel.size": 1, "pipeline_parallel.size": 1},
            2,
            "global_batch_size=3 with micro_batch_size=None splits over none",
        ),
    ],
)
def test_impossible_constraints_are_refused_saying_why(llama, constraints, world_size, message):
    with pytest.raises(ConstraintError, match=message):
        generate_plan(llama, {"sequence_length": 8, **constraints}, world_size=world_size)


def test_tensor_parallel_beyond_the_key_value_heads_is_planned(llama):
    # 8 query heads, 4 key/value heads: at tp=8 the key/value projections are replicated.
    plan = generate_plan(llama, {"sequence_length": 8, "tensor_parallel.size": 8}, world_size=8)
    assert dict(plan.mesh)["tp"] == 8


def test_gpt2_with_fused_attention_projections_plans_tensor_parallel():
    plan = generate_plan(
        build_tiny_hf_model("gpt2"), {"tensor_parallel.size": 2, "sequence_length": 8}, world_size=2
    )
    assert plan.mesh_size("tp") == 2 and "IS(" in plan.to_json()  # the q|k|v projection interleaved


def world_size_seen_by_generate_plan() -> int:
    return generate_plan(build_tiny_hf_model("llama"), {"sequence_length": 8}).world_size


def test_world_size_defaults_to_the_process_group_else_one():
    assert world_size_seen_by_generate_plan() == 1
    assert run_on_ranks(world_size_seen_by_generate_plan, 2, timeout_s=120) == [2, 2]


@pytest.mark.parametrize(
    ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"),
    [(32, 4096, 11008, 32, 32, 32000), (80, 8192, 28672, 64, 8, 128256)],
    ids=["llama-7b", "llama-70b"],
)
def test_llama_7b_and_70b_on_meta_plan_in_seconds_and_fit(
    layers, hidden, intermediate, heads, kv_heads, vocab
):
    sizes = dict(intermediate_size=intermediate, num_key_value_heads=kv_heads, vocab_size=vocab)
    model = meta_llama(hidden, layers, heads, max_position_embeddings=2048, **sizes)  # LlamaConfig's 2048
    constraints = {"memory_per_device_gb": 40, "devices_per_node": 8, "mixed_precision": "bf16"}
    constraints.update({"sequence_length": 4096, "global_batch_size": 64, "zero.stage": 1})
    started = time.perf_counter()
    plan = generate_plan(model, constraints, world_size=64)
    elapsed = time.perf_counter() - started
    assert elapsed < 60, f"planning took {elapsed:.1f} s"
    assert plan.memory_estimate.total <= 40 * _GIB and plan.world_size == 64
    assert plan.mesh_size("tp") <= 8 and kv_heads % plan.mesh_size("tp") == 0
    assert estimate_memory(model, plan) == plan.memory_estimate


def test_constraints_that_need_model_parallelism_steer_the_choice(llama):
    roomy = {"sequence_length": 8, "memory_per_device_gb": 1.0}
    plan = generate_plan(llama, {**roomy, "sequence_parallel": True}, world_size=4)
    assert plan.mesh_size("tp") == 2 and plan.sequence_parallel
    plan = generate_plan(llama, {**roomy, "pipeline_parallel.split_points": ["model.layers.1"]}, world_size=2)
    assert plan.pipeline.split_points == ("model.layers.1",) and plan.pipeline.split_method == "manual"
    # Without a global batch, a pipeline gets one micro-batch per stage.
    assert (plan.pipeline.num_microbatches, plan.global_batch_size) == (2, 2)


def test_the_default_budget_is_the_devices_memory(llama):
    from vescale.planner.generate import default_memory_per_device_gb

    plan = generate_plan(llama, {"sequence_length": 8}, world_size=2)
    assert plan.memory_per_device_gb == default_memory_per_device_gb(devices_per_node=2) > 0
    assert dict(plan.reasons)["memory_per_device_gb"] == "the device's memory"


def test_mixtral_from_deferred_init_is_planned_with_its_experts_profiled():
    from vescale.dmodule import deferred_init
    from vescale.dtensor import is_deferred
    from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
    from vescale.planner.profile import profile_model

    transformers = pytest.importorskip("transformers")
    config = tiny_hf_config("mixtral")
    model = deferred_init(transformers.AutoModelForCausalLM.from_config, config)
    constraints = {"tensor_parallel.size": 2, "sequence_parallel": True, "sequence_length": 8}
    plan = generate_plan(model, constraints, world_size=4)
    forward = plan.sharding_plan.to_dict()["forward"]
    # The experts' three inputs (tokens, expert ids, routing weights) enter replicated, so the routing
    # weights' gradient is reduced over tp at the experts; the MoE block gathers the sequence first.
    assert forward[r"model\.layers\.\d+\.mlp\.experts.input"] == ["R", "R", "R"]
    assert forward[r"model\.layers\.\d+\.mlp.input"] == ["R"]
    assert all(is_deferred(parameter) for parameter in model.parameters())  # the analysis put them back
    profile = profile_model(model, sequence_length=8)
    experts_bytes = sum(r.nbytes for r in profile.saved if r.block == 0 and r.module_fqn.endswith("experts"))
    # At least the fused gate|up output of every routed token: 8 tokens x 2 experts x 2 x 64 fp32 values.
    routed = 8 * config.num_experts_per_tok
    assert experts_bytes >= routed * 2 * config.intermediate_size * 4


def test_recomputation_is_chosen_in_order_none_selective_full_as_the_budget_shrinks(llama):
    # One device: no model parallelism and no ZeRO, only checkpointing can make the run fit. The
    # budgets: the estimate without recomputation, one byte less, one byte under selective's.
    sizes = {"sequence_length": 64, "micro_batch_size": 4, "global_batch_size": 4}

    def leanest(mode: str) -> int:
        choices = ParallelChoices(activation_checkpointing=mode, sequence_length=64, micro_batch_size=4)
        return estimate_memory(llama, choices).total  # ZeRO needs dp > 1: one device has stage 0

    none, selective, full = leanest("none"), leanest("selective"), leanest("full")
    assert full < selective < none
    chosen = {}
    for budget in (none, none - 1, selective - 1):
        plan = generate_plan(llama, {**sizes, "memory_per_device_gb": budget / _GIB}, world_size=1)
        chosen[budget] = plan.activation_checkpointing
        assert plan.memory_estimate.total <= budget
    assert list(chosen.values()) == ["none", "selective", "full"]
    plan = generate_plan(llama, {**sizes, "memory_per_device_gb": (none - 1) / _GIB}, world_size=1)
    assert "backward recomputes no matmul" in dict(plan.reasons)["activation_checkpointing"]


def _question_answering_llama():
    import transformers

    from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config

    return transformers.LlamaForQuestionAnswering(tiny_hf_config("llama"))


def test_a_model_whose_output_a_pipeline_cannot_return_is_never_given_one(llama):
    """A question-answering head returns start and end logits, which a pipeline cannot return (dpipe
    refuses it at parallelize). Where a language model's only plan is a pipeline, the planner finds
    none for it; a pipeline constraint is refused at once, naming the output type."""
    only_pipeline = {"tensor_parallel.size": 1, "data_parallel.size": 1, "sequence_length": 8}
    assert generate_plan(llama, only_pipeline, world_size=2).mesh_size("pp") == 2
    qa_model = _question_answering_llama()
    with pytest.raises(ConstraintError):
        generate_plan(qa_model, only_pipeline, world_size=2)
    with pytest.raises(ConstraintError, match="returns QuestionAnsweringModelOutput, which has no `loss`"):
        generate_plan(qa_model, {"pipeline_parallel.size": 2, "sequence_length": 8}, world_size=2)
    assert generate_plan(qa_model, {"sequence_length": 8}, world_size=2).mesh_size("pp") == 1


@pytest.mark.parametrize("hardware", [None, "h100-80gb"], ids=["rules", "cost-model"])
@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [
        ({"schedule": "zbv"}, ("zbv", 2)),
        # Rules: interleaved 1F1B; the cost model picks the faster of the schedules with v = 2.
        ({"virtual_stages": 2}, ("interleaved_1f1b", 2)),
        ({"schedule": "zero_bubble", "virtual_stages": 2}, ("zero_bubble", 2)),
        ({"schedule": "interleaved_1f1b", "virtual_stages": 4}, ("interleaved_1f1b", 4)),
    ],
    ids=["zbv", "virtual-stages", "zero-bubble-v2", "interleaved-v4"],
)
def test_pipeline_schedule_and_virtual_stages_constraints_reach_the_plan(hardware, pipeline, expected):
    # A user forces ZBV or several stages per rank by constraint, as any other choice; the plan
    # carries them to dpipe (rule-based and cost-model planning alike).
    model = meta_llama(hidden_size=128, num_hidden_layers=8, num_attention_heads=8, vocab_size=128)
    constraints = {
        "pipeline_parallel.size": 2,
        "global_batch_size": 8,
        "micro_batch_size": 1,
        "sequence_length": 16,
        **{f"pipeline_parallel.{key}": value for key, value in pipeline.items()},
    }
    if hardware is not None:
        constraints["hardware"] = hardware
    plan = generate_plan(model, constraints, world_size=2)
    schedule, virtual_stages = expected
    if hardware is not None and "schedule" not in pipeline:
        schedule = "zero_bubble"  # its predicted bubble, (pp - 1) / 3v, is the smallest at v = 2
    assert (plan.pipeline.schedule, plan.pipeline.virtual_stages) == (schedule, virtual_stages)
    assert plan.pipeline.num_stages == 2 * expected[1]
