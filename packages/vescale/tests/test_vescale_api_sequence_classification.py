"""``transformers`` sequence classifiers (classifiers, reward models) through the five-call API.

Their labels are one per row, not one per token: the planner's profile, the automatic tensor-
parallel plan and the pipeline split each trace the model on stand-in inputs, and passed token-
shaped labels, which every ``*ForSequenceClassification`` loss refuses ("Expected input
batch_size (2) to match target batch_size (16)"): ``generate_plan`` failed on every plan. The
stand-ins now follow the model's problem type (``vescale.dmodule.example_labels``).

Reference: the same tiny model (same seed) in one process, one forward and backward on the whole
global batch. Compared on every rank: the loss, and the gradient every parameter was stepped with
by one plain SGD step (``sgd_step_gradients``). Rows end in 0-3 pad tokens, so the classifier
pools each row's last real token.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
from vescale.dtensor.testing.numerics import assert_close_by_fqn, full_parameters, sgd_step_gradients

SGD_LR = 1e3
GLOBAL_BATCH = 8
SEQUENCE = 16
NUM_LABELS = 3
# Measured: losses equal, gradients within 7.9e-7 relative (float32 reordering; 4 cases);
# a stand-in that broke the pooling or the loss would not run, and a wrong gradient is off by 1e-2+.
LOSS_BOUND = 1e-6
GRADIENT_BOUND = 1e-5


def build_classifier(arch: str, problem_type: str | None, num_labels: int) -> torch.nn.Module:
    config = tiny_hf_config(arch)
    config.num_labels, config.problem_type, config.pad_token_id = num_labels, problem_type, 0
    return transformers.AutoModelForSequenceClassification.from_config(config)


def batch(arch: str, problem_type: str | None, num_labels: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(
        1, tiny_hf_config(arch).vocab_size, (GLOBAL_BATCH, SEQUENCE), generator=generator
    )
    for row in range(GLOBAL_BATCH):
        input_ids[row, SEQUENCE - row % 4 :] = 0  # pad tokens: the classifier pools the last real one
    if problem_type == "multi_label_classification":
        labels = torch.randint(0, 2, (GLOBAL_BATCH, num_labels), generator=generator).float()
    elif num_labels == 1:  # regression
        labels = torch.randn(GLOBAL_BATCH, generator=generator)
    else:
        labels = torch.randint(0, num_labels, (GLOBAL_BATCH,), generator=generator)
    return {"input_ids": input_ids, "labels": labels}


def classifier_step_on_rank(case: tuple, constraints: dict) -> tuple[float, dict]:
    vescale.manual_seed(0)
    model = vescale.deferred_init(build_classifier, *case)
    plan = vescale.generate_plan(
        model, {**constraints, "global_batch_size": GLOBAL_BATCH, "sequence_length": SEQUENCE}
    )
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.SGD(module.parameters(), lr=SGD_LR)
    )
    mesh = vescale.api.parallelize.mesh_of(model)
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = GLOBAL_BATCH // dp_size
    before = full_parameters(model)
    loss = model(
        **{key: value[dp_rank * rows : (dp_rank + 1) * rows] for key, value in batch(*case).items()}
    ).loss
    loss.backward()
    optimizer.step()
    return float(loss), sgd_step_gradients(before, full_parameters(model), SGD_LR)


@pytest.mark.parametrize(
    ("case", "constraints", "world_size"),
    [
        pytest.param(
            ("llama", None, NUM_LABELS),
            {"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 3},
            4,
            marks=pytest.mark.skipif(
                getattr(torch.distributed.fsdp, "DataParallelMeshDims", None) is None,
                reason="ZeRO-3 over tensor-parallel parameters needs torch 2.13's DataParallelMeshDims",
            ),
        ),
        (("llama", None, 1), {"tensor_parallel.size": 2}, 2),
        (("llama", "multi_label_classification", NUM_LABELS), {"data_parallel.size": 2}, 2),
        (("gpt2", None, NUM_LABELS), {"pipeline_parallel.size": 2}, 2),
    ],
    ids=["llama-single-label-dp2xtp2-zero3", "llama-regression-tp2", "llama-multi-label-dp2", "gpt2-pp2"],
)
def test_sequence_classifier_matches_single_device(case, constraints, world_size):
    torch.manual_seed(0)
    reference = build_classifier(*case)
    expected_loss = reference(**batch(*case)).loss
    expected_loss.backward()
    expected = {name: parameter.grad for name, parameter in reference.named_parameters()}
    covered: set[str] = set()
    for rank, (loss, gradients) in enumerate(
        run_on_ranks(classifier_step_on_rank, world_size, args=(case, constraints), timeout_s=300)
    ):
        assert abs(loss - float(expected_loss)) <= LOSS_BOUND * abs(float(expected_loss)), (rank, loss)
        assert_close_by_fqn(
            gradients, {name: expected[name] for name in gradients}, GRADIENT_BOUND, f"rank {rank} gradient"
        )
        covered |= set(gradients)
    assert covered == set(expected)  # the pipeline's ranks hold every parameter between them
