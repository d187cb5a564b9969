"""generate_plan's memory estimate against the measured peak of real AdamW steps (one rank).

Reference: the peak resident-set growth of one rank process over its baseline (after imports,
the process group and a warm-up step of a tiny model) while it builds a small Llama and trains
it for 2 AdamW steps (the second step holds the optimizer state from its start). The peak is
the kernel's own high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``): no
sampling, so a loaded machine cannot make it miss a short-lived tensor; glibc's mmap threshold
is fixed at 128 KiB so that freed tensors leave the resident set instead of staying as free heap (see
``tools/bench/plan_memory.py``, which measures the multi-rank plans the same way). The
compared quantity is estimate / measured peak, within the issue's +-15%: the estimate models
tensors only, and what it leaves out (the autograd graph, library buffers, a few MiB) is
below 5% of this model's ~130 MiB.
"""

from __future__ import annotations

import torch

from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import MEMORY_LLAMA_VOCAB, memory_llama_config

SEQUENCE, BATCH = 256, 2


def llama_config():
    return memory_llama_config(
        256, 768, num_attention_heads=4, num_key_value_heads=2, sequence_length=SEQUENCE
    )


def measured_training_peak() -> int:
    from transformers import LlamaForCausalLM

    from vescale.dtensor.testing.memory import (
        fix_mmap_threshold,
        high_water_mark_bytes,
        reset_high_water_mark,
        trimmed_resident_bytes,
        warm_up_training,
    )

    fix_mmap_threshold()
    warm_up_training()
    input_ids = torch.randint(
        0, MEMORY_LLAMA_VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1)
    )
    base = trimmed_resident_bytes()
    reset_high_water_mark()  # the high-water mark restarts from the current resident set
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return high_water_mark_bytes() - base


def test_generate_plan_estimate_is_within_15_percent_of_the_measured_peak():
    from transformers import LlamaForCausalLM

    from vescale.planner import generate_plan

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config())
    constraints = {"sequence_length": SEQUENCE, "micro_batch_size": BATCH, "global_batch_size": BATCH}
    plan = generate_plan(model, {**constraints, "memory_per_device_gb": 8.0}, world_size=1)
    (measured,) = run_on_ranks(measured_training_peak, 1, timeout_s=240)
    ratio = plan.memory_estimate.total / measured
    print(f"estimate {plan.memory_estimate.total / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert 0.85 <= ratio <= 1.15, (plan.memory_estimate, measured, ratio)
