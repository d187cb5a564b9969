"""estimate_memory: each part against an independent measurement of the same tiny model.

The references are real float32 runs on CPU: the bytes of a real forward's saved tensors (counted
per storage through ``saved_tensors_hooks``, as real memory is), the real gradients and AdamW
state after one step, and the local shards that ``parallelize_module`` leaves on 2 ranks. Sizes
are integers, so every comparison is exact. The parts are compared where they are all held (the
stage's sizes, and the optimizer-step moment for gradients); the peak's own composition is
tested in ``test_planner_peak.py``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from vescale.dmodule import parallelize_module, plan_tensor_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.meta_llama import meta_llama
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model, tiny_batch
from vescale.planner import MemoryEstimate, ParallelChoices, PlanError, estimate_memory
from vescale.planner.memory import stage_sizes
from vescale.planner.peak import peak_moments
from vescale.planner.profile import find_repeated_blocks, profile_model


def forward_activations(model: torch.nn.Module, choices: ParallelChoices) -> float:
    """The estimate of what the forward keeps for backward (the only stage's)."""
    profile = profile_model(model, choices.sequence_length, choices.micro_batch_size)
    (sizes,) = stage_sizes(profile, choices)
    return sizes.activations


def held_after_backward(model: torch.nn.Module, choices: ParallelChoices) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) the estimate says a rank holds at the optimizer step."""
    profile = profile_model(model, choices.sequence_length, choices.micro_batch_size)
    (sizes,) = stage_sizes(profile, choices)
    held = peak_moments(sizes, choices.data_parallel_size, choices.zero_stage)["optimizer step"]
    return int(held[0]), int(held[1]), int(held[2])


def real_activation_bytes(model: torch.nn.Module, batch_size: int, seq_len: int) -> int:
    """Bytes a real CPU forward saves for backward plus its outputs, once per storage, parameters excluded."""
    input_ids, labels = tiny_batch(model.config.vocab_size, batch_size=batch_size, seq_len=seq_len)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(input_ids=input_ids, labels=labels)
    for tensor in (output.loss, output.logits):
        pack(tensor)
    return sum(saved.values())


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_activation_estimate_equals_the_bytes_a_real_forward_keeps_for_backward(name):
    # Exact: both count the same storages; the meta run stands in fused attention for the math path
    # that meta tensors take, and the real CPU run uses the fused kernel too.
    model = build_tiny_hf_model(name)
    estimate = forward_activations(model, ParallelChoices(micro_batch_size=2, sequence_length=8))
    assert estimate == real_activation_bytes(model, batch_size=2, seq_len=8)


def test_parameter_gradient_and_optimizer_bytes_equal_a_real_adamw_step():
    model = build_tiny_hf_model("llama")
    input_ids, labels = tiny_batch(model.config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=input_ids, labels=labels).loss.backward()
    optimizer.step()
    moments = sum(
        state[key].nbytes for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")
    )
    parameters, gradients, optimizer_states = held_after_backward(model, ParallelChoices(sequence_length=8))
    assert parameters == sum(p.nbytes for p in model.parameters())
    assert gradients == sum(p.grad.nbytes for p in model.parameters())
    assert optimizer_states == moments


def test_zero_stages_divide_optimizer_state_then_gradients_then_parameters_over_dp():
    model = build_tiny_hf_model("llama")
    whole = held_after_backward(model, ParallelChoices(sequence_length=8, data_parallel_size=4))
    parts = [
        held_after_backward(model, ParallelChoices(sequence_length=8, data_parallel_size=4, zero_stage=stage))
        for stage in (1, 2, 3)
    ]
    parameters, gradients, optimizer_states = whole
    # 90752 parameter bytes are a multiple of 4, so the shares are exact.
    assert parts == [
        (parameters, gradients, optimizer_states // 4),
        (parameters, gradients // 4, optimizer_states // 4),
        (parameters // 4, gradients // 4, optimizer_states // 4),
    ]


def test_bf16_halves_parameters_and_gradients_and_adds_fp32_master_weights():
    model = build_tiny_hf_model("llama")
    fp32 = held_after_backward(model, ParallelChoices(sequence_length=8))
    bf16 = held_after_backward(model, ParallelChoices(sequence_length=8, mixed_precision="bf16"))
    assert bf16[:2] == (fp32[0] // 2, fp32[1] // 2)
    assert bf16[2] == fp32[2] * 12 // 8  # 2 moments + master, 4 bytes each
    fp32_activations = forward_activations(model, ParallelChoices(sequence_length=8))
    bf16_activations = forward_activations(model, ParallelChoices(sequence_length=8, mixed_precision="bf16"))
    assert bf16_activations < fp32_activations


def test_pipeline_stage_holds_its_blocks_and_the_larger_end_of_the_model():
    model = build_tiny_hf_model("llama")
    prefix, blocks = find_repeated_blocks(model)
    assert (prefix, len(blocks)) == ("model.layers", 2)
    first = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(("model.embed", "model.layers.0."))
    )
    last = sum(
        p.numel() for n, p in model.named_parameters() if not n.startswith(("model.embed", "model.layers.0."))
    )
    estimate = estimate_memory(model, ParallelChoices(sequence_length=8, pipeline_parallel_size=2))
    assert estimate.parameters == 4 * max(first, last)


def test_full_activation_checkpointing_keeps_block_inputs_and_one_block():
    model = build_tiny_hf_model("llama")
    none = forward_activations(model, ParallelChoices(sequence_length=8, micro_batch_size=2))
    full = forward_activations(
        model, ParallelChoices(sequence_length=8, micro_batch_size=2, activation_checkpointing="full")
    )
    block_input = 2 * 8 * 32 * 4  # (batch, sequence, hidden) float32
    # The forward keeps each block's input and what is saved outside the blocks.
    profile = profile_model(model, 8, 2)
    outside = sum(record.nbytes for record in profile.saved if record.block is None)
    assert full == 2 * block_input + outside < none


# Tiny Llama: hidden 32, 8 query heads and 4 key/value heads of 4, intermediate 64; a micro-batch
# of 2 x 8 tokens in float32 makes each row of `hidden` features 2 * 8 * 4 bytes.
ROW_BYTES = 2 * 8 * 4
BLOCK_INPUT = 32 * ROW_BYTES
COLUMN_OUTPUTS = (32 + 16 + 16 + 64 + 64) * ROW_BYTES  # q, k, v, gate and up projections
ATTENTION_KEPT = 32 * ROW_BYTES + 2 * 8 * 8 * 4  # the kernel's output, its log-sum-exp per head row
ROW_OUTPUTS = (32 + 32) * ROW_BYTES  # o and down projections


def test_selective_checkpointing_keeps_block_inputs_and_matmul_and_attention_outputs():
    # The reference is the model's shapes: what the selective policy keeps, counted by hand.
    model = build_tiny_hf_model("llama")
    profile = profile_model(model, 8, 2)
    outside = sum(record.nbytes for record in profile.saved if record.block is None)
    estimates = {
        mode: forward_activations(
            model, ParallelChoices(sequence_length=8, micro_batch_size=2, activation_checkpointing=mode)
        )
        for mode in ("none", "selective", "full")
    }
    per_block = BLOCK_INPUT + COLUMN_OUTPUTS + ATTENTION_KEPT + ROW_OUTPUTS
    assert estimates["selective"] == 2 * per_block + outside
    assert estimates["full"] < estimates["selective"] < estimates["none"]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_selective_checkpointing_under_tensor_parallelism_keeps_partial_sums_whole(sequence_parallel):
    # Column-parallel outputs and attention are this rank's heads (halved); a row-parallel matmul's
    # output is a partial sum of the whole shape, kept next to its reduction (all-reduce: whole;
    # reduce-scatter under SP: halved); the block input is halved by SP only.
    model = build_tiny_hf_model("llama")
    plan = plan_tensor_parallel(model).plan
    profile = profile_model(model, 8, 2)
    choices = ParallelChoices(
        sequence_length=8,
        micro_batch_size=2,
        tensor_parallel_size=2,
        sequence_parallel=sequence_parallel,
        sharding_plan=plan,
    )
    none = forward_activations(model, choices)
    full = forward_activations(model, dataclasses.replace(choices, activation_checkpointing="full"))
    selective = forward_activations(model, dataclasses.replace(choices, activation_checkpointing="selective"))
    outside = full - 2 * BLOCK_INPUT / (2 if sequence_parallel else 1)
    reduced = ROW_OUTPUTS / (2 if sequence_parallel else 1)
    per_block = (COLUMN_OUTPUTS + ATTENTION_KEPT) / 2 + ROW_OUTPUTS + reduced
    per_block += BLOCK_INPUT / (2 if sequence_parallel else 1)
    assert profile.num_blocks == 2
    assert selective == pytest.approx(2 * per_block + outside, abs=0.5)
    assert full < selective < none


def local_parameter_bytes_on_ranks(plan_dict: dict) -> int:
    from vescale.dmodule.sharding_plan import ShardingPlan

    model = build_tiny_hf_model("llama")
    parallelize_module(model, init_mesh(tp=2), ShardingPlan.from_dict(plan_dict))
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())


def test_tensor_parallel_parameter_bytes_equal_the_local_shards_of_parallelize_module():
    model = build_tiny_hf_model("llama")
    plan = plan_tensor_parallel(model).plan
    local = run_on_ranks(local_parameter_bytes_on_ranks, 2, args=(plan.to_dict(),), timeout_s=120)
    estimate = estimate_memory(
        model, ParallelChoices(sequence_length=8, tensor_parallel_size=2, sharding_plan=plan)
    )
    assert local == [estimate.parameters, estimate.parameters]


def test_tensor_and_sequence_parallel_divide_activations():
    model = build_tiny_hf_model("llama")
    plan = plan_tensor_parallel(model).plan
    sizes = dict(sequence_length=8, micro_batch_size=2, tensor_parallel_size=2, sharding_plan=plan)
    whole = forward_activations(model, ParallelChoices(sequence_length=8, micro_batch_size=2))
    tp = forward_activations(model, ParallelChoices(**sizes))
    sp = forward_activations(model, ParallelChoices(**sizes, sequence_parallel=True))
    # Column inputs stay whole on every rank, so TP divides by less than 2; SP also divides the norms.
    assert whole / 2 < sp < tp < whole


def test_a_70b_llama_on_meta_is_estimated_in_seconds():
    model = meta_llama(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64
    )
    started = time.perf_counter()
    estimate = estimate_memory(model, ParallelChoices(sequence_length=4096, mixed_precision="bf16"))
    elapsed = time.perf_counter() - started
    assert estimate.parameters == 2 * sum(p.numel() for p in model.parameters())  # 70.6e9 x 2 bytes
    assert elapsed < 30, f"estimating took {elapsed:.1f} s"


def test_estimate_memory_refuses_what_it_cannot_estimate():
    with pytest.raises(PlanError, match="takes a ParallelChoices or a Plan, got str"):
        estimate_memory(build_tiny_hf_model("llama"), "tp=2")
    with pytest.raises(PlanError, match="tensor_parallel_size=2 needs the sharding_plan"):
        estimate_memory(build_tiny_hf_model("llama"), ParallelChoices(tensor_parallel_size=2))


def test_data_dependent_shapes_are_estimated_with_a_warning(caplog):
    # transformers' eager experts loop over the experts their tokens hit (nonzero): data-dependent.
    # The model is not refused (issue #18); its default grouped-matmul experts are exact.
    eager_experts = build_tiny_hf_model("mixtral")
    eager_experts.config._experts_implementation = "eager"
    with caplog.at_level("WARNING", logger="vescale.planner"):
        estimate = estimate_memory(eager_experts, ParallelChoices(sequence_length=8))
    assert estimate.total > 0
    assert "lower bound" in caplog.text and "MixtralForCausalLM" in caplog.text


def test_memory_estimate_dict_round_trip_and_bad_parts():
    estimate = MemoryEstimate(parameters=1, gradients=2, optimizer_states=3, activations=4, temporaries=5)
    assert MemoryEstimate.from_dict(estimate.to_dict()) == estimate and estimate.total == 15
    # A plan written before the estimate had temporaries reads them as 0.
    older = {"parameters": 1, "gradients": 2, "optimizer_states": 3, "activations": 4}
    assert MemoryEstimate.from_dict(older) == MemoryEstimate(1, 2, 3, 4, 0)
    with pytest.raises(PlanError, match=r"memory_estimate\.activations must be a non-negative number"):
        MemoryEstimate.from_dict({**estimate.to_dict(), "activations": -1})
    with pytest.raises(PlanError, match="exactly the keys"):
        MemoryEstimate.from_dict({"parameters": 1})
