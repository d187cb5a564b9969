"""A pipeline's MoE load-balancing loss is that of every layer, as without a pipeline.

``transformers`` adds the router load-balancing loss once, at the end of the forward, from the
router logits of all MoE layers; a pipeline stage runs only its own layers, so without help
the last stage would compute it from its layers alone and the first stage's routers would get
no gradient from it. dpipe carries the routers' statistics (2E+1 sums) with the hidden state
(:mod:`vescale.dmodule.experts.router_statistics`).

Compared: tiny Mixtral (8 experts, top-2, ``output_router_logits=True``; two MoE layers, one
per stage) under pp2 with 1F1B and two micro-batches, against
``vescale.dtensor.testing.reference.train_reference`` on the same batches cut into the same
two micro-batches in order (PyTorch's schedules sum the micro-batches' gradients and divide by
m once: ``divide_gradients=True``); each micro-batch's loss includes the load-balancing loss of
that micro-batch over both layers, on both sides. Bounds: each step's loss 1e-6 relative (the
last stage re-adds the aux term as ``coef · (all layers' − its own)``: float32 rounding, measured
1.2e-7) and the first step's gradients 1e-5 relative (measured: bitwise). Without the carried
statistics the loss of step 1 is off by 1.7e-5 relative (measured), and the test fails.
"""

from __future__ import annotations

import torch

from vescale.dmodule.testing.moe_models import global_batch, tiny_moe
from vescale.dpipe import PipelinePlan, pipeline_parallelize
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.reference import assert_runs_match_reference, train_reference

STEPS = 2
BATCH_SIZE = 4
LR = 0.5
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5


def _batches() -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": ids, "labels": ids}
        for ids in (global_batch(seed=step + 1, batch_size=BATCH_SIZE) for step in range(STEPS))
    ]


def _pipeline_run() -> dict:
    torch.set_num_threads(1)
    model = tiny_moe("mixtral")
    pipe = pipeline_parallelize(
        model, init_mesh(pp=2), PipelinePlan(size=2, schedule="1f1b", num_microbatches=2)
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, gradients = [], {}
    for batch in _batches():
        out = pipe(**batch)
        out.loss.backward()
        gradients = gradients or {fqn: p.grad.clone() for fqn, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
    return {"losses": losses, "gradients": gradients}


def test_pp2_load_balancing_loss_counts_every_stages_routers():
    reference = train_reference(
        lambda: tiny_moe("mixtral"),
        _batches(),
        lambda model: torch.optim.SGD(model.parameters(), lr=LR),
        micro_batches=2,
        divide_gradients=True,
    )
    runs = run_on_ranks(_pipeline_run, 2)
    errors = assert_runs_match_reference(
        reference, runs, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL, label="mixtral pp2 1f1b"
    )
    print(f"mixtral pp2 with the load-balancing loss: loss {errors[0]:.2e}, gradient {errors[1]:.2e}")
