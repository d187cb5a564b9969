"""The ``ep`` mesh axis in the Plan and the constraints (issue #19): JSON, table, explain, errors."""

from __future__ import annotations

import json

import pytest

from vescale.doptim.plan import DataParallelPlan
from vescale.planner import Plan
from vescale.planner.constraints import Constraints
from vescale.planner.errors import ConstraintError, PlanFormatError


def _ep_plan(**overrides) -> Plan:
    fields = dict(
        mesh={"ep": 2, "dp": 2},
        data_parallel=DataParallelPlan(size=2, zero_stage=1),
        global_batch_size=8,
        capacity_factor=1.25,
    )
    fields.update(overrides)
    return Plan(**fields)


def test_an_expert_parallel_plan_round_trips_and_shows_its_ep_axis():
    plan = _ep_plan()
    assert plan.mesh == (("pp", 1), ("dp", 2), ("ep", 2), ("tp", 1))
    assert (plan.world_size, plan.batch_ranks, plan.num_microbatches) == (4, 4, 2)
    assert plan.expert_tensor_parallel is None and not plan.experts_split_over_tp
    text = plan.to_json()
    assert json.loads(text)["expert_parallel"] == {"expert_tensor_parallel": None, "capacity_factor": 1.25}
    assert Plan.from_json(text) == plan and Plan.from_json(text).to_json() == text
    table = str(plan)
    assert "expert parallel" in table and "2 (1/2 of the experts per rank" in table
    assert "capacity factor 1.25" in table and "dp x ep = 4" in table
    # A plan written before the section existed reads as ep=1 without one.
    old = json.loads(
        _ep_plan(mesh={"dp": 4}, data_parallel=DataParallelPlan(size=4), capacity_factor=None).to_json()
    )
    del old["expert_parallel"]
    assert Plan.from_dict(old).mesh_size("ep") == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"global_batch_size": 6}, r"global_batch_size=6 does not split into dp=2 x ep=2 ranks"),
        ({"expert_tensor_parallel": True}, "true only with mesh.tp > 1"),
        ({"capacity_factor": 0}, "capacity_factor must be a positive number or null"),
        (
            {"mesh": {"dp": 4}, "data_parallel": DataParallelPlan(size=4)},
            "capacity_factor is given but mesh.ep=1",
        ),
    ],
)
def test_bad_expert_parallel_fields_are_refused_by_name(overrides, message):
    with pytest.raises(PlanFormatError, match=message):
        _ep_plan(**overrides)


def test_expert_parallel_constraints():
    constraints = Constraints.from_dict({"expert_parallel": {"size": 2}, "tensor_parallel.size": 2})
    assert constraints.expert_parallel_size == 2
    constraints.check_world_size(8)
    world_error = r"expert_parallel\.size=2 = 8 devices, but the world size is 4"
    with pytest.raises(ConstraintError, match=world_error):
        Constraints.from_dict(
            {
                "data_parallel.size": 2,
                "tensor_parallel.size": 2,
                "pipeline_parallel.size": 1,
                "expert_parallel.size": 2,
            }
        ).check_world_size(4)
    with pytest.raises(ConstraintError, match="expert_tensor_parallel=True splits the experts"):
        Constraints.from_dict({"expert_tensor_parallel": True, "tensor_parallel.size": 1})
    with pytest.raises(ConstraintError, match=r"over data_parallel\.size x expert_parallel\.size = 4"):
        Constraints.from_dict(
            {
                "data_parallel.size": 2,
                "expert_parallel.size": 2,
                "global_batch_size": 6,
                "micro_batch_size": 1,
            }
        )


def test_generate_plan_obeys_the_expert_parallel_constraint():
    from vescale.dmodule.testing.moe_models import tiny_moe
    from vescale.planner import generate_plan

    model = tiny_moe("mixtral")
    constraints = {"expert_parallel.size": 2, "tensor_parallel.size": 2, "sequence_length": 8}
    plan = generate_plan(model, constraints, world_size=8)
    assert plan.mesh == (("pp", 1), ("dp", 2), ("ep", 2), ("tp", 2)) and plan.world_size == 8
    assert plan.global_batch_size % (plan.batch_ranks * plan.micro_batch_size) == 0
    assert not plan.experts_split_over_tp and Plan.from_json(plan.to_json()) == plan
    uneven = r"does not divide the 8 experts of model\.layers\.0\.mlp\.experts"
    with pytest.raises(ConstraintError, match=uneven):
        generate_plan(model, {"expert_parallel.size": 3}, world_size=3)


def test_the_memory_estimate_counts_e_over_ep_experts():
    from vescale.dmodule.testing.moe_models import tiny_moe
    from vescale.planner.memory import ParallelChoices, estimate_memory

    model = tiny_moe("mixtral")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    replicated = estimate_memory(model, ParallelChoices(data_parallel_size=4, sequence_length=8))
    sharded = estimate_memory(model, ParallelChoices(expert_parallel_size=4, sequence_length=8))
    # fp32 parameters: all of them, or the rest plus a quarter of the experts.
    assert replicated.parameters == 4 * total
    assert sharded.parameters == 4 * (total - experts + experts // 4)
    zero1 = estimate_memory(
        model, ParallelChoices(data_parallel_size=2, expert_parallel_size=2, zero_stage=1, sequence_length=8)
    )
    # AdamW's two fp32 moments: the rest over dp x ep = 4, the experts (1/2 per rank) over dp = 2.
    assert zero1.optimizer_states == int(8 * ((total - experts) / 4 + experts / 2 / 2))


def _mixtral_plan(budget_bytes: int, **constraints):
    from vescale.dmodule.testing.moe_models import tiny_moe
    from vescale.planner import generate_plan

    budget = {"memory_per_device_gb": budget_bytes / 2**30, "sequence_length": 8}
    return generate_plan(tiny_moe("mixtral"), {**budget, **constraints}, world_size=4)


def test_the_planner_chooses_ep_when_the_replicated_experts_do_not_fit():
    """Tiny Mixtral on 4 devices, fp32, one sequence of 8 tokens per rank: 1.09 MB per device with the
    experts replicated (ZeRO-0; 0.62 MB under ZeRO-3), 0.63 MB at ep2, 0.43 MB at ep4 (estimates).
    A budget of 0.8 MB fits only with the experts split: the rules take the smallest ep that fits
    before a higher ZeRO stage (an all-to-all of the tokens instead of gathering every expert)."""
    from vescale.dmodule.testing.moe_models import tiny_moe
    from vescale.planner.memory import estimate_memory

    plan = _mixtral_plan(800_000)
    assert plan.mesh == (("pp", 1), ("dp", 2), ("ep", 2), ("tp", 1))
    assert plan.data_parallel.zero_stage == 0 and "smallest ep size" in dict(plan.reasons)["expert_parallel"]
    assert plan.memory_estimate.total <= 800_000
    assert estimate_memory(tiny_moe("mixtral"), plan.parallel_choices()) == plan.memory_estimate
    # Without ZeRO, nothing but ep makes it fit; at 0.5 MB only ep4 does.
    assert _mixtral_plan(800_000, **{"zero.stage": 0}).mesh_size("ep") == 2
    assert _mixtral_plan(500_000).mesh_size("ep") == 4


def test_the_planner_keeps_experts_replicated_when_they_fit():
    """With room for the replicated experts (2 MB) the plan is plain data parallelism: no all-to-all;
    a dense model never gets an ep axis."""
    from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model
    from vescale.planner import generate_plan

    plan = _mixtral_plan(2_000_000)
    assert plan.mesh == (("pp", 1), ("dp", 4), ("ep", 1), ("tp", 1))
    assert dict(plan.reasons)["expert_parallel"].startswith("1: ")
    llama = build_tiny_hf_model("llama")
    assert generate_plan(llama, {"sequence_length": 8}, world_size=4).mesh_size("ep") == 1


def test_the_memory_estimate_counts_the_dispatch_buffers():
    """Under ep the temporaries at the end of backward include one MoE layer's all-to-all send and
    receive buffers: 2 x tokens x top-k x hidden x 4 bytes (fp32)."""
    from vescale.dmodule.testing.moe_models import tiny_moe
    from vescale.planner.memory import ParallelChoices, stage_sizes
    from vescale.planner.profile import profile_model

    model = tiny_moe("mixtral")
    profile = profile_model(model, 8)
    (sizes,) = stage_sizes(profile, ParallelChoices(expert_parallel_size=4, sequence_length=8))
    assert profile.expert_top_k == 2
    assert sizes.dispatch_buffers == 2 * (8 * 2 * model.config.hidden_size * 4)
    (replicated,) = stage_sizes(profile, ParallelChoices(data_parallel_size=4, sequence_length=8))
    assert replicated.dispatch_buffers == 0


def _meta_mixtral(num_experts: int):
    import torch
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


def _cost_plan(num_experts: int, world_size: int, **constraints):
    from vescale.planner import generate_plan

    given = {"hardware": "h100-80gb", "sequence_length": 1024, "mixed_precision": "bf16"}
    given["global_batch_size"] = world_size  # one sequence per device unless told otherwise
    return generate_plan(_meta_mixtral(num_experts), {**given, **constraints}, world_size=world_size)


def test_the_cost_model_chooses_ep_when_the_all_to_all_costs_less_than_gathering_the_experts():
    """A Mixtral-style model with 64 experts (3.3 B parameters, 3.0 B in experts), one 1024-token
    sequence per device on two H100 nodes: ZeRO-3 over 16 ranks gathers every expert each
    micro-batch across nodes; expert parallelism sends each token's hidden state to 2 experts. The
    cost model picks ep (4 inside a node), and prices its all-to-alls in the breakdown."""
    plan = _cost_plan(64, 16)
    assert plan.mesh_size("ep") > 1, plan.mesh
    assert dict(plan.performance.breakdown)["expert_parallel"] > 0
    assert "fastest predicted" in dict(plan.reasons)["expert_parallel"]


def test_the_cost_model_keeps_few_experts_replicated_and_prices_an_ep_constraint():
    """8 experts on one node of 8 H100s, eight 4096-token sequences per device: ZeRO-3 hides its
    gathers under the compute, and ep would only add all-to-alls, so ep stays 1 (with one
    1024-token sequence per device the gathers are exposed and ep2 wins). With
    expert_parallel.size=2 given, the cost model plans around it (no refusal): 4 all-to-alls per
    MoE layer and micro-batch of tokens x top-k x hidden in bf16."""
    from vescale.planner._collectives import all_to_all_seconds, axis_link
    from vescale.planner.hardware import load_hardware

    busy = _cost_plan(8, 8, global_batch_size=64, sequence_length=4096)
    assert busy.mesh == (("pp", 1), ("dp", 8), ("ep", 1), ("tp", 1)), busy.mesh
    assert "expert_parallel" not in dict(busy.performance.breakdown)
    plan = _cost_plan(8, 8, **{"expert_parallel.size": 2, "activation_checkpointing": "none"})
    assert plan.mesh_size("ep") == 2
    tp = plan.mesh_size("tp")
    link = axis_link(load_hardware("h100-80gb", world_size=8), 2, tp, 8)
    layers = 8 // plan.mesh_size("pp")
    hidden_states = plan.micro_batch_size * plan.sequence_length * 1024 * 2  # tokens x hidden x bf16
    expected = plan.num_microbatches * layers * 4 * all_to_all_seconds(link, hidden_states * 2)
    assert abs(dict(plan.performance.breakdown)["expert_parallel"] - expected) <= 1e-12 * expected
