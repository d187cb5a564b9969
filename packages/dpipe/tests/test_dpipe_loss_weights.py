"""Micro-batch loss weights (``PipelineModule.set_microbatch_loss_weights``): padded labels give
one device's loss and gradients.

A ``transformers`` causal LM's loss is the mean over the tokens whose (shifted) label is not
``-100``. Where the micro-batches hold unequal numbers of such tokens, the mean of their means
is not the batch's mean; weighting micro-batch ``i`` by ``terms_i / terms`` is. Reference: the
same tiny GPT-2 (tied ``wte``/``lm_head``) in one process on the whole padded batch. Compared:
the loss on every rank and every parameter's gradient, read back from one SGD step. The bounds
are those of ``test_dpipe_accuracy.py`` (float32 reordering of the micro-batch accumulation,
measured below 1e-6); the unweighted mean of means, also checked, moves the gradients by more
than 10x the bound.
"""

from __future__ import annotations

import pytest
import torch

from vescale.dpipe import MicrobatchError, PipelinePlan, pipeline_parallelize
from vescale.dpipe.testing import (
    GLOBAL_BATCH,
    LOSS_RTOL,
    SEQ_LEN,
    SGD_LR,
    build_model,
    schedule_plan,
    training_batches,
)
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import errors_by_fqn, full_parameters, sgd_step_gradients
from vescale.dtensor.testing.reference import assert_matches_reference, micro_batch, train_reference

GRAD_RTOL = 1e-5
NUM_MICROBATCHES = 4


def padded_batch() -> dict[str, torch.Tensor]:
    """The first training batch, its labels padded by 0-4 tokens a row: unequal terms per micro-batch."""
    input_ids = training_batches(build_model("gpt2").config.vocab_size)[0]
    labels = input_ids.clone()
    for row in range(GLOBAL_BATCH):
        labels[row, SEQ_LEN - row % 5 :] = -100
    return {"input_ids": input_ids, "labels": labels}


def micro_batch_terms(labels: torch.Tensor) -> list[int]:
    """Each micro-batch's loss terms: labels other than -100 after the causal LM's one-token shift."""
    rows = labels.shape[0] // NUM_MICROBATCHES
    return [int((piece[:, 1:] != -100).sum()) for piece in labels.split(rows)]


def weighted_pipeline_step(schedule: str) -> dict:
    """pp2: the weighted and the unweighted loss, then one weighted SGD step's gradients."""
    model = build_model("gpt2")
    pipe = pipeline_parallelize(model, init_mesh(pp=2), PipelinePlan.from_dict(schedule_plan(schedule, 2)))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=SGD_LR)
    batch = padded_batch()
    terms = micro_batch_terms(batch["labels"])
    weights = [count / sum(terms) for count in terms]
    with pytest.raises(MicrobatchError, match="3 micro-batch loss weights were given for a pipeline of "):
        pipe.set_microbatch_loss_weights(weights[:3])
    with torch.no_grad():
        pipe.set_microbatch_loss_weights(weights)
        weighted = pipe(**batch).loss.item()
        # The weights are for one call only, one that raises included.
        pipe.set_microbatch_loss_weights(weights)
        with pytest.raises(MicrobatchError, match="cannot be cut into 4 equal micro-batches"):
            pipe(**{name: value[:-1] for name, value in batch.items()})
        unweighted = pipe(**batch).loss.item()
    before = full_parameters(model)
    pipe.set_microbatch_loss_weights(weights)
    loss = pipe(**batch).loss
    loss.backward()
    optimizer.step()
    gradients = sgd_step_gradients(before, full_parameters(model), SGD_LR)
    return {"losses": [weighted, loss.item()], "unweighted": unweighted, "gradients": gradients}


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_weighted_micro_batches_of_padded_labels_match_single_device(schedule: str):
    batch = padded_batch()
    terms = micro_batch_terms(batch["labels"])
    assert len(set(terms)) > 1, terms  # the padding makes the micro-batches differ
    reference = train_reference(
        lambda: build_model("gpt2"), [batch], lambda model: torch.optim.SGD(model.parameters(), lr=SGD_LR)
    )
    # The padding matters: the mean of the micro-batch means moves the gradients by far more than
    # the bound (the losses of an untrained model differ little between micro-batches).
    model = build_model("gpt2")
    mean_of_means = (
        sum(model(**micro_batch(batch, index, NUM_MICROBATCHES)).loss for index in range(NUM_MICROBATCHES))
        / NUM_MICROBATCHES
    )
    mean_of_means.backward()
    unweighted_gradients = {fqn: parameter.grad for fqn, parameter in model.named_parameters()}
    shift = errors_by_fqn(unweighted_gradients, reference.first_gradients(unweighted_gradients))
    assert max(shift.values()) > 10 * GRAD_RTOL, shift
    runs = run_on_ranks(weighted_pipeline_step, world_size=2, args=(schedule,), timeout_s=300)
    for run in runs:
        assert run["unweighted"] == pytest.approx(mean_of_means.item(), rel=LOSS_RTOL)
    loss_error, gradient_error = assert_matches_reference(
        reference,
        [run["losses"][:1] for run in runs] + [run["losses"][1:] for run in runs],
        [run["gradients"] for run in runs],
        loss_rtol=LOSS_RTOL,
        grad_rtol=GRAD_RTOL,
        label=f"pp2 {schedule}",
    )
    print(f"pp2 {schedule}: loss {loss_error:.2e}, gradient {gradient_error:.2e}")
