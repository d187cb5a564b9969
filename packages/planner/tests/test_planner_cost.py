"""The step-time model and the search: collectives on the links an axis spans, the parts of a
step, pipeline schedules, stage boundaries, constraints that win, and deterministic answers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vescale.dmodule import plan_tensor_parallel
from vescale.dtensor.testing.models.meta_llama import meta_llama
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model
from vescale.planner import ConstraintError, ParallelChoices, generate_plan
from vescale.planner._collectives import all_gather_seconds, all_reduce_seconds, axis_link
from vescale.planner.cost import balanced_split, predict_step
from vescale.planner.hardware import load_hardware
from vescale.planner.profile import profile_model

H100 = load_hardware("h100-80gb")


def _meta_llama(layers: int = 8, hidden: int = 1024, vocab: int = 32000) -> torch.nn.Module:
    return meta_llama(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )


@pytest.fixture(scope="module")
def llama_profile():
    return profile_model(_meta_llama(), 2048, 1)


def test_an_axis_inside_a_node_uses_nvlink_and_one_across_nodes_the_adapters():
    inside = axis_link(H100, size=8, stride=1)
    across = axis_link(H100, size=16, stride=8)  # dp over 16 nodes, tp 8 inside each
    spread = axis_link(H100, size=64, stride=1)  # 8 members in each of 8 nodes
    assert not inside.crosses_nodes and across.crosses_nodes
    assert inside.bandwidth == pytest.approx(450e9 * 0.8)
    assert across.bandwidth == pytest.approx(50e9 * 0.8)
    assert spread.bandwidth == pytest.approx(min(450e9, 8 * 50e9) * 0.8)
    nbytes = 1e9
    assert all_reduce_seconds(inside, nbytes) == pytest.approx(
        14 * inside.latency + 2 * 7 / 8 * nbytes / inside.bandwidth
    )
    assert all_reduce_seconds(inside, nbytes) == pytest.approx(2 * all_gather_seconds(inside, nbytes))
    assert all_reduce_seconds(axis_link(H100, 1, 1), nbytes) == 0.0


def _choices(**overrides) -> ParallelChoices:
    base = dict(sequence_length=2048, mixed_precision="bf16", data_parallel_size=8, zero_stage=1)
    return ParallelChoices(**{**base, **overrides})


def test_the_parts_add_up_and_recomputation_costs_what_it_reruns(llama_profile):
    costs = {
        mode: predict_step(llama_profile, _choices(activation_checkpointing=mode), H100)
        for mode in ("none", "selective", "full")
    }
    for cost in costs.values():
        assert cost.step_time_s == pytest.approx(sum(seconds for _, seconds in cost.breakdown))
    recompute = {mode: dict(cost.breakdown)["recompute"] for mode, cost in costs.items()}
    assert recompute["none"] == 0 < recompute["selective"] < recompute["full"]
    # Full recomputation reruns the blocks' forward: about a third of their forward + backward.
    compute = dict(costs["full"].breakdown)["compute"]
    assert 0.2 < recompute["full"] / compute < 0.34
    # Model FLOPs are 3x the forward, recomputation excluded: the same for every mode.
    assert len({cost.model_flops for cost in costs.values()}) == 1


def test_pipeline_bubbles_follow_the_schedule(llama_profile):
    def bubble(schedule: str, virtual: int = 1) -> float:
        choices = _choices(
            pipeline_parallel_size=4, data_parallel_size=2, num_microbatches=8, schedule=schedule
        )
        cost = predict_step(llama_profile, choices, H100, virtual_stages=virtual)
        return dict(cost.breakdown)["pipeline_bubble"]

    assert bubble("gpipe") == pytest.approx(bubble("1f1b"))
    assert bubble("interleaved_1f1b", 2) == pytest.approx(bubble("1f1b") / 2)
    assert bubble("zero_bubble") == pytest.approx(bubble("1f1b") / 3)


def test_stage_boundaries_balance_the_stages(llama_profile):
    choices = _choices(pipeline_parallel_size=2, data_parallel_size=4, num_microbatches=4)
    split = balanced_split(llama_profile, choices, H100)
    assert len(split) == 1 and 3 <= split[0] <= 5
    # A head far heavier than a block (a large vocabulary) moves blocks to the first stage.
    heavy_head = profile_model(_meta_llama(vocab=512000), 2048, 1)
    assert balanced_split(heavy_head, choices, H100)[0] > 4


def test_tensor_parallel_communication_appears_with_tp():
    model = _meta_llama()
    profile = profile_model(model, 2048, 1)
    sharding = plan_tensor_parallel(model).plan
    cost = predict_step(
        profile,
        _choices(tensor_parallel_size=8, data_parallel_size=1, zero_stage=0, sharding_plan=sharding),
        H100,
    )
    assert dict(cost.breakdown)["tensor_parallel"] > 0


def test_the_search_obeys_constraints_and_answers_the_same_every_time():
    model = build_tiny_hf_model("llama")
    constraints = {"hardware": "h100-80gb", "sequence_length": 16, "global_batch_size": 8}
    first = generate_plan(model, constraints, world_size=4)
    assert first.to_dict() == generate_plan(model, constraints, world_size=4).to_dict()
    assert first.performance is not None and first.performance.hardware == "h100-80gb"
    assert first.performance.runners_up
    assert "runners-up" in first.explain()
    forced = generate_plan(
        model,
        {**constraints, "tensor_parallel.size": 2, "zero.stage": 1, "mixed_precision": "fp32"},
        world_size=4,
    )
    assert (forced.mesh_size("tp"), forced.data_parallel.zero_stage, forced.mixed_precision) == (2, 1, "fp32")
    with pytest.raises(ConstraintError, match="no plan fits"):
        generate_plan(model, {**constraints, "memory_per_device_gb": 1e-6}, world_size=4)


def _rules_over_choice(plan) -> float:
    """The rule-based choice's predicted time per sample over the chosen plan's, from its reason."""
    reason = dict(plan.reasons)["rule_based_choice"]
    return float(reason.rsplit("s, ", 1)[1].split("x")[0])


def test_the_chosen_plan_is_never_slower_by_the_model_than_the_rule_based_choice():
    model = build_tiny_hf_model("llama")
    for world_size, budget in ((2, 1.0), (4, 1.0), (4, 0.0004)):
        constraints = {"sequence_length": 16, "global_batch_size": 8, "memory_per_device_gb": budget}
        plan = generate_plan(model, {**constraints, "hardware": "a100-80gb"}, world_size=world_size)
        assert _rules_over_choice(plan) >= 1.0 - 1e-9, dict(plan.reasons)["rule_based_choice"]


def test_where_memory_is_tight_the_choice_beats_the_rules_by_a_tenth_in_a_third_of_the_cells():
    """Issue #20: budgets under the estimate of the plan that saves no memory (every rank data
    parallel, ZeRO-0, no recomputation); both sides in fp32, so the gain is the layout's."""
    model = build_tiny_hf_model("llama")
    base = {"sequence_length": 64, "global_batch_size": 8, "mixed_precision": "fp32", "hardware": "a100-80gb"}
    ratios = []
    for world_size in (4, 8):
        roomy = generate_plan(
            model,
            {**base, "data_parallel.size": world_size, "zero.stage": 0, "activation_checkpointing": "none"},
            world_size=world_size,
        )
        for share in (0.8, 0.5, 0.3):
            budget = roomy.memory_estimate.total * share
            plan = generate_plan(
                model, {**base, "memory_per_device_gb": budget / 2**30}, world_size=world_size
            )
            assert plan.memory_estimate.total <= budget
            ratios.append(_rules_over_choice(plan))
    assert min(ratios) >= 1.0 - 1e-9, ratios
    assert 3 * sum(ratio >= 1.1 for ratio in ratios) >= len(ratios), ratios


def test_bf16_is_chosen_on_accelerators_unless_constrained():
    model = build_tiny_hf_model("llama")
    plan = generate_plan(model, {"hardware": "h100-80gb", "sequence_length": 16}, world_size=2)
    assert plan.mixed_precision == "bf16"
    performance = plan.performance
    assert 0 < performance.mfu < 1
    assert performance.tokens_per_s == pytest.approx(
        plan.global_batch_size * plan.sequence_length / performance.step_time_s
    )


def test_a_tighter_budget_keeps_the_chosen_plan_inside_it():
    model = _meta_llama()
    hardware = dataclasses.replace(H100, memory_gb=3.0)
    plan = generate_plan(
        model, {"sequence_length": 2048, "global_batch_size": 16}, world_size=8, hardware=hardware
    )
    assert plan.memory_estimate.total <= 3.0 * 2**30 * 0.95
