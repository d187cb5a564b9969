"""The peak moment of a training step: which parts each moment holds, exactly, for a tiny Llama.

The expected bytes are computed here from the model's own parameters (float32, 4 bytes each)
and the documented behaviour of the packages that run the step (doptim's persistent ZeRO-0/1
gradient buckets and its parameter all-gather of at most two buckets at once, FSDP2 keeping the root unit
unsharded through backward, autograd producing the head's gradients first), never from the
estimator; every size is an integer, so every comparison is exact. That the moments add up
to a measured peak is what ``tools/bench/plan_memory.py`` measures.
"""

from __future__ import annotations

import dataclasses

import pytest

from vescale.dmodule import plan_tensor_parallel
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model
from vescale.planner import ParallelChoices, estimate_memory, generate_plan
from vescale.planner.hardware import load_hardware
from vescale.planner.memory import stage_sizes
from vescale.planner.peak import DEFAULT_BUCKET_BYTES, StageSizes, peak_moments
from vescale.planner.profile import profile_model

BATCH, SEQUENCE = 2, 8


@pytest.fixture(scope="module")
def llama():
    return build_tiny_hf_model("llama")


def parameter_bytes(model, prefixes: tuple[str, ...] = ("",)) -> int:
    return sum(4 * p.numel() for name, p in model.named_parameters() if name.startswith(prefixes))


def logits_bytes(model) -> int:
    return 4 * BATCH * SEQUENCE * model.config.vocab_size


def moments_of(model, **choices):
    choices = ParallelChoices(micro_batch_size=BATCH, sequence_length=SEQUENCE, **choices)
    (sizes,) = stage_sizes(profile_model(model, SEQUENCE, BATCH), choices)
    return sizes, peak_moments(sizes, choices.data_parallel_size, choices.zero_stage)


def test_the_estimate_is_the_largest_moment_and_its_parts_add_up(llama):
    choices = ParallelChoices(
        micro_batch_size=BATCH, sequence_length=SEQUENCE, data_parallel_size=2, zero_stage=1
    )
    _, moments = moments_of(llama, data_parallel_size=2, zero_stage=1)
    largest = max(moments.values(), key=sum)
    estimate = estimate_memory(llama, choices, publish_in_place=False)
    names = ["parameters", "gradients", "optimizer_states", "activations", "temporaries"]
    assert estimate.to_dict() == dict(zip(names, (int(part) for part in largest), strict=True))
    assert estimate.total == max(sum(int(part) for part in parts) for parts in moments.values())


def test_zero1_keeps_every_gradient_through_backward_and_all_gathers_the_buckets_at_the_step(llama):
    whole = parameter_bytes(llama)
    assert whole < DEFAULT_BUCKET_BYTES  # one bucket holds the whole tiny model
    sizes, moments = moments_of(llama, data_parallel_size=2, zero_stage=1)
    start = moments["start of backward"]
    # Persistent buckets: every gradient is held while the forward's activations still are.
    assert start[:2] == (whole, whole) and start[3] == sizes.activations
    assert start[2] == 2 * whole / 2  # two fp32 moments per 4-byte element, over dp=2
    assert start[4] == 2 * logits_bytes(llama)  # gradients of the log-probabilities and of the logits
    step = moments["optimizer step"]
    # The gathered parameters (the one bucket) beside this rank's chunk of it (1/dp).
    assert step[3] == 0 and step[4] == whole + whole // 2


def test_zero3_holds_the_unsharded_root_and_one_block_through_backward(llama):
    whole = parameter_bytes(llama)
    root = whole - parameter_bytes(llama, ("model.layers.",))
    block = parameter_bytes(llama, ("model.layers.0.",))
    head = parameter_bytes(llama, ("lm_head.", "model.norm."))
    _, moments = moments_of(llama, data_parallel_size=2, zero_stage=3)
    parameters, gradients, _, _, temporaries = moments["start of backward"]
    assert parameters == whole / 2
    assert gradients == head / 2  # the head's sharded gradients come first
    assert temporaries == root + block + 2 * logits_bytes(llama)
    assert moments["end of backward"][1] == whole / 2
    # Deep in backward: the root, the block computed, the one prefetched and a block's gradients.
    assert moments["end of backward"][4] == root + 3 * block


def test_tensor_parallel_without_dp_holds_only_the_heads_gradients_when_backward_starts(llama):
    plan = plan_tensor_parallel(llama).plan
    _, moments = moments_of(llama, tensor_parallel_size=2, sharding_plan=plan)
    # lm_head is sharded over tp; the final norm is whole on every tp rank.
    head = parameter_bytes(llama, ("lm_head.",)) // 2 + parameter_bytes(llama, ("model.norm.",))
    assert moments["start of backward"][1] == head
    local = moments["optimizer step"][1]
    assert local < parameter_bytes(llama) and moments["optimizer step"][3] == 0


def test_zero2_holds_one_bucket_at_backward_start_and_its_chunks_after(llama):
    whole = parameter_bytes(llama)
    _, moments = moments_of(llama, data_parallel_size=4, zero_stage=2)
    assert moments["start of backward"][1] == min(whole, DEFAULT_BUCKET_BYTES)
    assert moments["optimizer step"][1] == whole / 4


def test_full_checkpointing_recomputes_a_block_once_the_heads_activations_are_freed(llama):
    none, _ = moments_of(llama)
    full, moments = moments_of(llama, activation_checkpointing="full")
    assert full.activations < none.activations
    profile = profile_model(llama, SEQUENCE, BATCH)
    # The largest block: the first, which also saves the rotary tables.
    block = max(sum(record.nbytes for record in profile.saved if record.block == index) for index in (0, 1))
    head = sum(record.nbytes for record in profile.saved if record.block is None and record.side == "last")
    assert full.recompute == max(0, block - head)
    assert moments["start of backward"][4] == max(2 * logits_bytes(llama), full.recompute)


def test_accumulated_micro_batches_start_backward_with_every_gradient_held(llama):
    one_micro_batch = moments_of(llama)[1]
    sizes, _ = moments_of(llama)
    accumulating = peak_moments(sizes, 1, 0, num_microbatches=2)
    whole = parameter_bytes(llama)
    head = parameter_bytes(llama, ("lm_head.", "model.norm."))
    assert one_micro_batch["start of backward"][1] == head
    assert accumulating["start of backward"][1] == whole
    estimate = estimate_memory(
        llama, ParallelChoices(micro_batch_size=BATCH, sequence_length=SEQUENCE, num_microbatches=2)
    )
    assert estimate.total == max(sum(int(part) for part in parts) for parts in accumulating.values())


def test_zero1_gathers_at_most_two_buckets_at_once_and_none_where_it_broadcasts_in_place():
    bucket = DEFAULT_BUCKET_BYTES
    sizes = StageSizes(
        parameters=10 * bucket,
        outside_parameters=bucket,
        head_parameters=bucket / 2,
        largest_block_parameters=bucket,
        largest_parameter=bucket / 4,
        optimizer_states=5 * bucket,
        activations=bucket,
        last_activations=bucket / 4,
        loss_gradients=bucket / 8,
        recompute=0,
    )
    for zero in (1, 2):
        step = peak_moments(sizes, 4, zero)["optimizer step"]
        # doptim publishes bucket by bucket, two in flight: each gathered beside this rank's chunk.
        assert step[4] == 2 * bucket + 2 * bucket / 4, zero
        # On gloo it broadcasts each owner's range in place: only AdamW's two per-tensor buffers.
        in_place = peak_moments(sizes, 4, zero, publish_in_place=True)["optimizer step"]
        assert in_place[4] == 2 * sizes.largest_parameter / 4, zero


def test_a_plan_for_cpu_ranks_counts_no_gather_buffers_and_one_for_gpus_does(llama):
    a100 = load_hardware("a100-80gb")
    constraints = {
        "data_parallel.size": 2,
        "zero.stage": 1,
        "activation_checkpointing": "full",
        "micro_batch_size": 1,  # the search's own profile, not one scaled to another batch
        "global_batch_size": 2,
        "sequence_length": SEQUENCE,
        "mixed_precision": "fp32",
        "memory_per_device_gb": 1.0,
    }
    gpus = generate_plan(llama, constraints, world_size=2, hardware=a100)
    cpus = generate_plan(llama, constraints, world_size=2, hardware=dataclasses.replace(a100, name="cpu"))
    whole = parameter_bytes(llama)
    # GPUs all-gather the one bucket beside this rank's chunk at the step, its largest moment here.
    assert gpus.memory_estimate.temporaries == whole + whole // 2
    assert cpus.memory_estimate.total < gpus.memory_estimate.total
    # estimate_memory of a plan assumes what generate_plan assumed for its hardware.
    assert estimate_memory(llama, gpus) == gpus.memory_estimate
    assert estimate_memory(llama, cpus) == cpus.memory_estimate


def test_a_pipelines_last_stage_keeps_every_micro_batchs_logits_and_under_gpipe_every_activation(llama):
    microbatches = 4

    def stages(schedule):
        choices = ParallelChoices(
            micro_batch_size=BATCH,
            sequence_length=SEQUENCE,
            pipeline_parallel_size=2,
            num_microbatches=microbatches,
            schedule=schedule,
        )
        return stage_sizes(profile_model(llama, SEQUENCE, BATCH), choices)

    (first, last), (gpipe_first, gpipe_last) = stages("1f1b"), stages("gpipe")
    # 1F1B: one micro-batch in flight on the last stage, its logits among its activations;
    # vescale.dpipe keeps the other micro-batches' logits to return them all.
    assert last.kept_outputs == (microbatches - 1) * logits_bytes(llama)
    # GPipe runs every forward before any backward: every stage holds every micro-batch.
    assert gpipe_last.activations == microbatches * last.activations and gpipe_last.kept_outputs == 0
    assert gpipe_first.activations == 2 * first.activations  # 1F1B's first stage: pp = 2 in flight
    assert first.kept_outputs == gpipe_first.kept_outputs == 0
    start = peak_moments(last, 1, 0, num_microbatches=microbatches)["start of backward"]
    assert start[3] == last.activations + last.kept_outputs
