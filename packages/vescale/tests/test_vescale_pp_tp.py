"""Pipeline x tensor parallel: PP2 x TP2 on 4 ranks trains like one device, for every schedule.

Quantity compared: the loss of each of 10 AdamW steps (every rank returns the whole batch's
loss), against the same tiny ``transformers`` model (Llama untied, GPT-2 with ``wte`` tied
to ``lm_head``), seed and batches trained in one process on the whole batch (float32, one
thread). The parallel run applies dmodule's automatic TP plan over ``tp`` first (every
parameter a DTensor on the full ``pp x tp`` mesh), then cuts the model into pipeline stages
over ``pp``; hidden states cross stages as the plain Replicate tensor and are wrapped back
into DTensors by the next stage (``vescale.dpipe.dtensor_boundary``). Every micro-batch row
has the same token count, so the mean of the micro-batch mean losses is the batch's mean
loss; what differs is float32 summation order (tp partial sums, micro-batch gradient
accumulation, the tied copies' sum across stages). That rounding (~1e-7 relative per step)
is amplified by AdamW over the steps (measured: 7.9e-6 for Llama, 1.1e-7 for GPT-2; see
``tools/dpipe_accuracy.py``), hence the issue's bound of 1e-4 relative.
"""

from __future__ import annotations

import pytest

from vescale.dpipe.testing import (
    LOSS_RTOL,
    SCHEDULES,
    pipeline_training_losses_per_schedule,
    reference_training_losses,
)
from vescale.dtensor.testing import run_on_ranks


@pytest.mark.parametrize("model_name", ["llama", "gpt2"])
def test_pp2_tp2_matches_single_device_training_for_every_schedule(model_name: str):
    reference = reference_training_losses(model_name)
    results = run_on_ranks(
        pipeline_training_losses_per_schedule,
        world_size=4,
        args=(model_name, {"pp": 2, "tp": 2}, SCHEDULES),
        timeout_s=400,
    )
    for rank, losses_per_schedule in enumerate(results):
        for schedule, losses in losses_per_schedule.items():
            for step, (loss, expected) in enumerate(zip(losses, reference, strict=True)):
                error = abs(loss - expected) / abs(expected)
                assert error <= LOSS_RTOL, (
                    f"rank {rank} {schedule} step {step}: {loss} vs {expected} ({error:.1e})"
                )
