"""The stand-in labels a traced forward passes: token-shaped for token losses, one per row for
``transformers``' sequence classifiers, in the dtype and shape their problem type's loss takes.

Each case also runs the model's own forward on meta tensors with those labels, so a shape its
loss refuses fails here (``Expected input batch_size (2) to match target batch_size (16)`` was
what token-shaped labels gave every ``*ForSequenceClassification``).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from vescale.dmodule.example_labels import example_labels
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config

SEQ_CLS = transformers.AutoModelForSequenceClassification


def _meta_model(factory, problem_type: str | None = None, num_labels: int = 2) -> torch.nn.Module:
    config = tiny_hf_config("llama")
    config.problem_type, config.num_labels, config.pad_token_id = problem_type, num_labels, 0
    with torch.device("meta"):
        return factory.from_config(config)


@pytest.mark.parametrize(
    ("factory", "problem_type", "num_labels", "shape", "dtype"),
    [
        (transformers.AutoModelForCausalLM, None, 2, (2, 8), torch.long),
        (transformers.AutoModelForTokenClassification, None, 3, (2, 8), torch.long),
        (SEQ_CLS, None, 3, (2,), torch.long),
        (SEQ_CLS, "single_label_classification", 3, (2,), torch.long),
        (SEQ_CLS, None, 1, (2,), torch.float32),
        (SEQ_CLS, "regression", 3, (2, 3), torch.float32),
        (SEQ_CLS, "multi_label_classification", 3, (2, 3), torch.float32),
    ],
    ids=["causal-lm", "token-cls", "seq-cls", "single-label", "regression-1", "regression-3", "multi-label"],
)
def test_example_labels_fit_the_models_loss(factory, problem_type, num_labels, shape, dtype):
    model = _meta_model(factory, problem_type, num_labels)
    input_ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    labels = example_labels(model, input_ids)
    assert (tuple(labels.shape), labels.dtype) == (shape, dtype)
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=labels).loss
    assert loss.shape == ()
