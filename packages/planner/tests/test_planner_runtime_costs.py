"""What the step-time model charges for the runtime around the math: fused attention's own
efficiency curve, a backend whose reduce-scatter is a whole all-reduce (gloo), the host time of
DTensor redistributions, and ``vescale.parallelize``'s global-batch loss reductions (issue #20)."""

from __future__ import annotations

import dataclasses

import pytest

from vescale.dmodule import plan_tensor_parallel
from vescale.dtensor.testing.models.meta_llama import meta_llama
from vescale.planner import ParallelChoices
from vescale.planner._collectives import all_gather_seconds, all_reduce_seconds, axis_link
from vescale.planner._meta_forward import meta_parameters
from vescale.planner.cost import predict_step
from vescale.planner.errors import PlanError
from vescale.planner.hardware import HardwareProfile, load_hardware
from vescale.planner.profile import profile_model

A100 = load_hardware("a100-80gb")


@pytest.fixture(scope="module")
def llama():
    model = meta_llama(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        vocab_size=1024,
        max_position_embeddings=2048,
    )
    with meta_parameters(model):
        sharding = plan_tensor_parallel(model).plan
    return profile_model(model, 2048, 1), sharding


def _part(profile, choices, hardware, name):
    return dict(predict_step(profile, choices, hardware).breakdown)[name]


def test_attention_follows_its_own_curve_where_the_profile_has_one(llama):
    profile, _ = llama
    choices = ParallelChoices(sequence_length=2048, mixed_precision="bf16")
    efficiency, half_dim = A100.attention_curve()
    assert (efficiency, half_dim) == (A100.matmul_efficiency, A100.matmul_half_dim)
    # The same curve given explicitly predicts the same step; a slower kernel a longer one, by
    # exactly the attention calls' extra time.
    same = dataclasses.replace(A100, attention_efficiency=efficiency, attention_half_dim=half_dim)
    assert predict_step(profile, choices, same) == predict_step(profile, choices, A100)
    slower = dataclasses.replace(A100, attention_efficiency=efficiency / 4)
    attention = [op for op in profile.op_costs if op.kind == "attention"]
    head_dim = attention[0].dims[2]
    forward = sum(op.flops for op in attention) / (
        A100.peak_flops("bf16") * efficiency * head_dim / (head_dim + half_dim)
    )
    # Each attention call (compute-bound at 2,048 tokens) takes 4x as long: 3 more forwards, and
    # backward 2.5x of that.
    extra = 3 * forward * (1 + 2.5)
    difference = _part(profile, choices, slower, "compute") - _part(profile, choices, A100, "compute")
    assert difference == pytest.approx(extra, rel=1e-6)


def test_a_reduce_scatter_costs_a_whole_all_reduce_where_the_backend_has_none(llama):
    profile, _ = llama
    gloo_like = dataclasses.replace(A100, reduce_scatter_is_all_reduce=True)
    link, ring = axis_link(gloo_like, 8, 1), axis_link(A100, 8, 1)
    assert link.reduce_scatter_is_all_reduce and not ring.reduce_scatter_is_all_reduce
    zero2 = ParallelChoices(sequence_length=2048, mixed_precision="bf16", data_parallel_size=8, zero_stage=2)
    # ZeRO-2's gradient reduce-scatter is what differs, by the all-reduce's second half.
    gradient_bytes = sum(record.numel for record in profile.parameters) * 2.0
    expected = all_reduce_seconds(link, gradient_bytes) - all_gather_seconds(link, gradient_bytes)
    difference = _part(profile, zero2, gloo_like, "data_parallel") - _part(
        profile, zero2, A100, "data_parallel"
    )
    assert difference == pytest.approx(expected, rel=1e-6)


def test_each_tensor_parallel_collective_pays_the_redistribution_host_time(llama):
    profile, sharding = llama
    overhead_us = 500.0
    host = dataclasses.replace(A100, redistribute_overhead_us=overhead_us)
    row_parallel = [
        op
        for op in profile.op_costs
        if op.kind == "matmul"
        and op.output_bytes
        and any(
            fqn.endswith(("o_proj.weight", "down_proj.weight"))
            for fqn in profile.module_parameters.get(op.module_fqn, ())
        )
    ]
    assert len(row_parallel) == 4  # two blocks, attention and MLP each
    for sequence_parallel, collectives in ((False, 1), (True, 2)):
        choices = ParallelChoices(
            sequence_length=2048,
            mixed_precision="bf16",
            tensor_parallel_size=4,
            sequence_parallel=sequence_parallel,
            sharding_plan=sharding,
        )
        difference = _part(profile, choices, host, "tensor_parallel") - _part(
            profile, choices, A100, "tensor_parallel"
        )
        # Forward and backward (2x) of every row-parallel op's collectives.
        assert difference == pytest.approx(2 * len(row_parallel) * collectives * overhead_us * 1e-6, rel=1e-6)


def test_the_global_batch_loss_costs_two_scalar_all_reduces_over_the_batch_ranks(llama):
    profile, _ = llama
    slow_links = dataclasses.replace(A100, intra_node_latency_us=1000.0)
    choices = ParallelChoices(
        sequence_length=2048, mixed_precision="bf16", data_parallel_size=4, zero_stage=0
    )
    link = axis_link(slow_links, 4, 1)
    # The gradients' all-reduce is exposed beyond the backward it overlaps; the scalars are not.
    fast, slow = (
        _part(profile, choices, A100, "data_parallel"),
        _part(profile, choices, slow_links, "data_parallel"),
    )
    scalars = 2 * all_reduce_seconds(link, 16.0) - 2 * all_reduce_seconds(axis_link(A100, 4, 1), 16.0)
    assert slow - fast >= scalars - 1e-12
    single = ParallelChoices(sequence_length=2048, mixed_precision="bf16", data_parallel_size=1)
    assert _part(profile, single, slow_links, "data_parallel") == 0.0


def test_a_profile_refuses_a_nonpositive_attention_figure():
    for field in ("attention_efficiency", "attention_half_dim"):
        with pytest.raises(PlanError, match=field):
            dataclasses.replace(A100, **{field: 0.0})
    profile = dataclasses.replace(
        A100, attention_efficiency=0.4, attention_half_dim=14.0, redistribute_overhead_us=0.0
    )
    assert HardwareProfile.from_dict(profile.to_dict()) == profile
