"""Pipeline x tensor parallel: PP2 x TP2 on 4 ranks trains like one device, for every schedule.

Quantities compared, against the same tiny ``transformers`` model (Llama untied, GPT-2 with
``wte`` tied to ``lm_head``), seed and batches trained in one process on the whole batch
(float32, one thread): the loss of each of 10 AdamW steps (every rank returns the whole batch's
loss), and every parameter's first-step gradient, read back from one plain SGD step of the same
parallel model (what the optimizer applied after the micro-batch accumulation, the tp
reductions and the tied copies' sum across stages). The parallel run applies dmodule's
automatic TP plan over ``tp`` first (every parameter a DTensor on the full ``pp x tp`` mesh),
then cuts the model into pipeline stages over ``pp``; hidden states cross stages as the plain
Replicate tensor and are wrapped back into DTensors by the next stage
(``vescale.dpipe.dtensor_boundary``). What differs from one process is float32 summation order
(tp partial sums, micro-batch gradient accumulation, the tied copies' sum across stages). That
rounding (~1e-7 relative per step) is amplified by AdamW over the steps (measured: 7.9e-6 for
Llama, 1.1e-7 for GPT-2; see ``tools/dpipe_accuracy.py``), hence the issue's bound of 1e-4
relative on the losses; the gradients' bound is set from their measured floor (``GRAD_RTOL``).
"""

from __future__ import annotations

import pytest

from vescale.dpipe.testing import assert_every_schedule_matches_single_device

# Worst first-step gradient over every FQN, measured: 7.40e-7 (Llama) and 7.24e-7 (GPT-2)
# relative, the same for every schedule. The bound, 1e-5, is 13x that floor; a gradient off by
# x2 errs by 1.0.
GRAD_RTOL = 1e-5


@pytest.mark.parametrize("model_name", ["llama", "gpt2"])
def test_pp2_tp2_matches_single_device_training_for_every_schedule(model_name: str):
    assert_every_schedule_matches_single_device(model_name, {"pp": 2, "tp": 2}, grad_rtol=GRAD_RTOL)
