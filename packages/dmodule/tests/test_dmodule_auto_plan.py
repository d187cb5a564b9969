"""Automatic TP/SP plans: what they decide, and that they train like the single-process model.

The plan tests trace models on the meta device and check the decisions that Megatron's
rules dictate. The training tests apply the automatic plan with ``parallelize_module`` and
compare with the same model, same weights and batches, run in one process: the loss within
1e-5 relative, every gradient within 1e-4 (``vescale.dtensor.testing.numerics``), and the
losses of 20 AdamW steps within 1e-4 at every step. A sharded matmul sums in another order
than the single-device one, so float32 results agree to a few ulps, not bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vescale.dmodule.auto_plan import auto_sharding_plan, plan_tensor_parallel
from vescale.dmodule.errors import ShardingPlanError
from vescale.dmodule.parallelize import parallelize_module
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import full_value, gradient_errors, relative_error

transformers = pytest.importorskip("transformers")

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
STEP_LOSS_RTOL = 1e-4
MODELS = ("llama", "mistral", "gpt2", "mixtral", "nanogpt")


def _meta_model(name: str, **overrides):
    from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model
    from vescale.dtensor.testing.models.tp_plans import build_test_model

    with torch.device("meta"):
        if not overrides and name in MODELS:
            return build_test_model(name)
        # Held-out architectures: 4 query heads of 8 dims, so that fused parts have telling sizes.
        sizes = {"num_attention_heads": 4, "head_dim": 8, "pad_token_id": 0, **overrides}
        return build_tiny_hf_model(name, **sizes)


def _parameter_plan(plan) -> dict[str, str]:
    from vescale.dtensor.placements import placement_to_string

    return {pattern: placement_to_string(placements[0]) for pattern, placements in plan.parameter}


def test_llama_attention_and_mlp_pair_column_to_row_and_shard_the_vocabulary():
    model = _meta_model("llama")
    result = plan_tensor_parallel(model, sequence_parallel=True)
    placements = _parameter_plan(result.plan)
    for projection in ("q_proj", "k_proj", "v_proj"):
        assert placements[rf"model\.layers\.\d+\.self_attn\.{projection}\.weight"] == "S(0)"
    assert placements[r"model\.layers\.\d+\.self_attn\.o_proj\.weight"] == "S(1)"
    assert placements[r"model\.layers\.\d+\.mlp\.down_proj\.weight"] == "S(1)"
    assert placements[r"model\.embed_tokens\.weight"] == placements[r"lm_head\.weight"] == "S(0)"
    forward = result.plan.to_dict()["forward"]
    assert forward[r"model\.layers\.\d+\.mlp\.down_proj.output"] == ["S(1)"]
    assert forward["lm_head.output"] == ["S(-1)"]
    # Only query heads bind the TP size: fewer key/value heads than ranks are replicated.
    assert result.head_counts == (model.config.num_attention_heads,)


def test_gpt2_fused_qkv_is_interleaved_and_conv1d_orientation_is_respected():
    placements = _parameter_plan(auto_sharding_plan(_meta_model("gpt2")))
    # Conv1D stores (in, out): column-parallel shards dim 1, row-parallel dim 0.
    assert placements[r"transformer\.h\.\d+\.attn\.c_attn\.weight"] == "IS(1,3)"
    assert placements[r"transformer\.h\.\d+\.attn\.c_attn\.bias"] == "IS(0,3)"
    assert placements[r"transformer\.h\.\d+\.attn\.c_proj\.weight"] == "S(0)"
    assert placements[r"transformer\.h\.\d+\.mlp\.c_fc\.weight"] == "S(1)"


def test_mixtral_router_stays_replicated_and_fused_experts_are_interleaved():
    result = plan_tensor_parallel(_meta_model("mixtral"))
    placements = _parameter_plan(result.plan)
    assert placements[r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj"] == "IS(1,2)"
    assert placements[r"model\.layers\.\d+\.mlp\.experts\.down_proj"] == "S(2)"
    assert not any("mlp\\.gate\\." in pattern for pattern in placements)
    decisions = dict(result.decisions)
    assert decisions["model.layers.0.mlp.gate.weight"].startswith("replicated: its output feeds routing")
    assert "replicated" in result.explain()


def test_held_out_architectures_are_planned_from_their_dataflow():
    qwen3 = _parameter_plan(auto_sharding_plan(_meta_model("qwen3")))  # q/k norms per head
    assert qwen3[r"model\.layers\.\d+\.self_attn\.q_proj\.weight"] == "S(0)"
    assert qwen3[r"model\.layers\.\d+\.self_attn\.o_proj\.weight"] == "S(1)"
    phi3 = _parameter_plan(auto_sharding_plan(_meta_model("phi3", num_key_value_heads=4)))  # q|k|v sliced
    assert phi3[r"model\.layers\.\d+\.self_attn\.qkv_proj\.weight"] == "IS(0,3)"
    assert phi3[r"model\.layers\.\d+\.mlp\.gate_up_proj\.weight"] == "IS(0,2)"
    olmo = _parameter_plan(auto_sharding_plan(_meta_model("olmo")))
    assert olmo[r"model\.layers\.\d+\.mlp\.down_proj\.weight"] == "S(1)"


def test_unequal_fused_parts_are_replicated_with_the_reason():
    result = plan_tensor_parallel(_meta_model("phi3", num_key_value_heads=2))
    reason = dict(result.decisions)["model.layers.0.self_attn.qkv_proj.weight"]
    expected = "its output is cut into unequal fused parts [32, 16, 16], which InterleavedShard cannot shard"
    assert reason == f"replicated: {expected}"


def test_tp_size_that_splits_a_head_is_refused_with_the_head_counts():
    model = _meta_model("llama")
    query_heads, key_value_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    result = plan_tensor_parallel(model)
    result.check_tp_size(key_value_heads)
    result.check_tp_size(query_heads)  # beyond the key/value heads: they are replicated
    with pytest.raises(
        ShardingPlanError, match=rf"size of 3 does not divide the head counts \[{query_heads}\]"
    ):
        result.check_tp_size(3)


def auto_plan_training_errors(name: str, mesh_dims: dict, sequence_parallel: bool, steps: int) -> dict:
    from vescale.dtensor.testing.models.tp_plans import build_test_model, model_loss

    mesh = init_mesh(**mesh_dims)
    model = build_test_model(name)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 8), generator=generator) for _ in range(steps)]
    parallelize_module(model, mesh, auto_sharding_plan(model, sequence_parallel=sequence_parallel))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    result = {"step_loss_errors": []}
    for step, batch in enumerate(batches):
        loss = model_loss(model, name, batch, batch)
        reference_loss = model_loss(reference, name, batch, batch)
        loss.backward()
        reference_loss.backward()
        if step == 0:
            result["loss_error"] = relative_error(loss, reference_loss)
            result["grad_errors"] = gradient_errors(model, reference)
        result["step_loss_errors"].append(relative_error(loss, reference_loss))
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    result["final_loss"] = full_value(loss).item()
    return result


TRAINING_CASES = [
    pytest.param(name, {"tp": tp}, sp, id=f"{name}-tp{tp}-{'sp' if sp else 'nosp'}")
    for name in MODELS
    for tp in (2, 4)
    for sp in (False, True)
] + [pytest.param(name, {"dp": 2, "tp": 2}, True, id=f"{name}-dp2xtp2-sp") for name in ("llama", "gpt2")]


@pytest.mark.parametrize(("name", "mesh_dims", "sequence_parallel"), TRAINING_CASES)
def test_automatic_plan_trains_like_the_single_device_model(name, mesh_dims, sequence_parallel):
    world_size = 1
    for size in mesh_dims.values():
        world_size *= size
    results = run_on_ranks(
        auto_plan_training_errors, world_size=world_size, args=(name, mesh_dims, sequence_parallel, 20)
    )
    for result in results:
        assert result["loss_error"] <= LOSS_RTOL
        worst = max(result["grad_errors"], key=result["grad_errors"].get)
        assert result["grad_errors"][worst] <= GRAD_RTOL, (worst, result["grad_errors"][worst])
        assert max(result["step_loss_errors"]) <= STEP_LOSS_RTOL, result["step_loss_errors"]
    assert len({result["final_loss"] for result in results}) == 1  # every rank reports the same loss


def test_plan_entries_are_sorted_by_pattern_so_every_process_builds_an_equal_plan():
    # The trace records consumers in sets, whose order changes with each process's hash seed.
    for name in ("llama", "gpt2", "mixtral"):
        plan = auto_sharding_plan(_meta_model(name), sequence_parallel=True)
        parameter_patterns = [pattern for pattern, _ in plan.parameter]
        forward_keys = list(plan.to_dict()["forward"])
        assert parameter_patterns == sorted(parameter_patterns), name
        assert forward_keys == sorted(forward_keys), name
