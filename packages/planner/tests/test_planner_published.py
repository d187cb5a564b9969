"""The step-time model against published measurements (issue #20), each pinned within +-20%.

* torchtitan, Llama 3.1 on H100 (``benchmarks/llama3_h100_202412_torchtitan.md``): Grand Teton
  hosts, H100 with 96 GB HBM2e at 2.4 TB/s capped at 500 W ("peak between SXM and NVL": the
  NVL part's 835 bf16 TFLOP/s is used). The profile's one free figure, its matmul efficiency,
  is fitted on the 8B eager FSDP run (Table 1) and then held for the others. The 70B and
  405B runs used torch.compile and Float8 linears (405B also AsyncTP), which neither veScale's
  runtime nor this model has: the model's bf16 eager prediction is scaled by torchtitan's own
  measured gains of those techniques (Table 1: 8,532 / 5,762 for compile + Float8; Table 4:
  876 / 829 for AsyncTP). Pipeline micro-batches are torchtitan's default of that release, one
  per stage.
* Korthikanti et al. 2022 (Reducing Activation Recomputation, Table 5): GPT-3-style 22B (tp 8)
  and 175B (tp 8 x pp 8) on A100-80GB, full recomputation vs selective + sequence parallelism,
  on the built-in ``a100-80gb`` profile with nothing fitted.
* Narayanan et al. 2021 (Megatron-LM, Figure 10): for 175B on 1,536 A100s, ZeRO-3 alone loses
  to tensor x pipeline parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch
import transformers

from vescale.dmodule import plan_tensor_parallel
from vescale.dtensor.testing.models.meta_llama import meta_llama
from vescale.planner import ParallelChoices, generate_plan
from vescale.planner._meta_forward import meta_parameters
from vescale.planner._profile_scaling import scaled_profile
from vescale.planner.cost import predict_step
from vescale.planner.hardware import load_hardware
from vescale.planner.profile import profile_model

GRAND_TETON_H100 = dataclasses.replace(
    load_hardware("h100-80gb"),
    name="grand-teton-h100",
    peak_tflops=(("bf16", 835.0), ("fp32", 60.0)),
    memory_gb=96.0,
    memory_bandwidth=2.4e12,
    matmul_efficiency=0.5,  # fitted on the 8B eager FSDP run
)
COMPILE_AND_FLOAT8 = 8532 / 5762
ASYNC_TP = 876 / 829
TOLERANCE = 0.2


@functools.cache
def _llama(hidden: int, intermediate: int, layers: int, heads: int) -> torch.nn.Module:
    return meta_llama(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
    )


@functools.cache
def _gpt3(hidden: int, layers: int, heads: int) -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        vocab_size=51200,
        n_positions=2048,
        activation_function="gelu_pytorch_tanh",
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@functools.cache
def _profile(model: torch.nn.Module, sequence_length: int):
    return profile_model(model, sequence_length, 1)


def _step(
    model, sequence_length, hardware, *, tp, pp, dp, micro, count, recompute, zero, schedule="1f1b", v=1
):
    sharding = None
    if tp > 1:
        with meta_parameters(model):
            sharding = plan_tensor_parallel(model).plan
    choices = ParallelChoices(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        sequence_parallel=tp > 1,
        zero_stage=zero,
        micro_batch_size=micro,
        sequence_length=sequence_length,
        num_microbatches=count,
        schedule=schedule,
        mixed_precision="bf16",
        activation_checkpointing=recompute,
        sharding_plan=sharding,
    )
    profile = scaled_profile(_profile(model, sequence_length), micro)
    return predict_step(profile, choices, hardware, virtual_stages=v)


def _tokens_per_device(cost, micro, count, dp, world, sequence_length=8192) -> float:
    return micro * count * dp * sequence_length / cost.step_time_s / world


TORCHTITAN = [
    # name, model, (tp, pp, dp), micro-batch, micro-batches, recomputation, schedule, v, gain, published
    ("8B FSDP", (4096, 14336, 32, 32), (1, 1, 8), 2, 1, "selective", "1f1b", 1, 1.0, 5762),
    ("70B FSDP32xTP8", (8192, 28672, 80, 64), (8, 1, 32), 16, 1, "full", "1f1b", 1, COMPILE_AND_FLOAT8, 829),
    (
        "405B 3-D 1F1B",
        (16384, 53248, 126, 128),
        (8, 8, 8),
        4,
        8,
        "full",
        "1f1b",
        1,
        COMPILE_AND_FLOAT8 * ASYNC_TP,
        100,
    ),
    (
        "405B 3-D interleaved",
        (16384, 53248, 126, 128),
        (8, 8, 8),
        2,
        16,
        "full",
        "interleaved_1f1b",
        2,
        COMPILE_AND_FLOAT8 * ASYNC_TP,
        128,
    ),
]


@pytest.mark.parametrize("case", TORCHTITAN, ids=[case[0] for case in TORCHTITAN])
def test_torchtitan_llama3_on_h100(case):
    _, dims, (tp, pp, dp), micro, count, recompute, schedule, v, gain, published = case
    cost = _step(
        _llama(*dims),
        8192,
        GRAND_TETON_H100,
        tp=tp,
        pp=pp,
        dp=dp,
        micro=micro,
        count=count,
        recompute=recompute,
        zero=3,
        schedule=schedule,
        v=v,
    )
    predicted = gain * _tokens_per_device(cost, micro, count, dp, tp * pp * dp)
    assert abs(predicted / published - 1) <= TOLERANCE, f"{predicted:.0f} tokens/s per GPU vs {published}"


KORTHIKANTI = [
    # name, (hidden, layers, heads), (tp, pp), batch, micro-batches, full-recompute s, selective + SP s
    ("22B", (6144, 48, 64), (8, 1), 4, 1, 1.42, 1.10),
    ("175B", (12288, 96, 96), (8, 8), 1, 64, 18.13, 13.75),
]


@pytest.mark.parametrize("case", KORTHIKANTI, ids=[case[0] for case in KORTHIKANTI])
def test_korthikanti_selective_recomputation_step_times(case):
    _, dims, (tp, pp), micro, count, full_s, selective_s = case
    model, a100 = _gpt3(*dims), load_hardware("a100-80gb")
    for recompute, published in (("full", full_s), ("selective", selective_s)):
        cost = _step(
            model, 2048, a100, tp=tp, pp=pp, dp=1, micro=micro, count=count, recompute=recompute, zero=0
        )
        assert abs(cost.step_time_s / published - 1) <= TOLERANCE, f"{recompute}: {cost.step_time_s:.2f} s"


@pytest.mark.xfail(
    strict=True,
    reason="not reproduced: the model predicts ZeRO-3 at 19.0 s vs 19.3 s for tp8 x pp8 (1F1B) per 1,536 "
    "sequences, a tie where Megatron measured 3x; it hides most of ZeRO-3's per-block gathers under "
    "compute, and has no cost for the SMs NCCL takes from overlapped compute nor DeepSpeed-2021's "
    "exposed gathers (issue #20)",
)
def test_megatron_zero3_alone_loses_to_tensor_times_pipeline_at_1536_gpus():
    model, a100 = _gpt3(12288, 96, 96), load_hardware("a100-80gb")
    zero3 = _step(model, 2048, a100, tp=1, pp=1, dp=1536, micro=1, count=1, recompute="full", zero=3)
    ptdp = _step(model, 2048, a100, tp=8, pp=8, dp=24, micro=1, count=64, recompute="full", zero=1)
    # Both steps run 1,536 sequences; Megatron measured ~44 vs ~148 TFLOP/s per GPU.
    assert zero3.step_time_s > 1.2 * ptdp.step_time_s


def test_planning_speed_and_choices_at_scale():
    started = time.process_time()
    plan = generate_plan(
        _llama(8192, 28672, 80, 64), {"sequence_length": 8192}, world_size=1024, hardware="h100-80gb"
    )
    assert time.process_time() - started <= 10.0
    assert plan.mixed_precision == "bf16" and plan.mesh_size("tp") <= 8
    assert 0.2 < plan.performance.mfu < 0.8 and "MFU" in str(plan)
    started = time.process_time()
    plan = generate_plan(
        _llama(16384, 53248, 126, 128), {"sequence_length": 8192}, world_size=16384, hardware="h100-80gb"
    )
    assert time.process_time() - started <= 30.0
    assert plan.memory_estimate.total <= 80 * 2**30
