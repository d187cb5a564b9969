"""Stand-in labels for tracing a model without data: the shape and dtype its loss expects.

The automatic sharding plan, the planner's profile and the pipeline split each run a model's
forward once on stand-in token ids, with labels where the forward takes them, so that the
trace reaches the loss. A language model's labels are shaped like its token ids; a
``transformers`` sequence classifier (``*ForSequenceClassification``, the head of reward
models and classifiers) takes one label per row, and its loss refuses labels shaped like the
token ids. :func:`example_labels` gives each the labels it takes, following
``transformers``' own rule for the problem type: class indices for single-label
classification, floats for regression (one per row, or ``num_labels`` per row) and for
multi-label classification.

Example::

    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    example_labels(LlamaForSequenceClassification(config), ids).shape   # torch.Size([2])
    example_labels(LlamaForCausalLM(config), ids) is ids                  # True
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["example_labels"]

_SEQUENCE_CLASSIFIER_SUFFIX = "ForSequenceClassification"


def _float_dtype(model: nn.Module) -> torch.dtype:
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    return parameter.dtype if parameter is not None else torch.get_default_dtype()


def example_labels(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The ``labels`` to pass ``model`` beside ``input_ids`` (``rows x sequence``) in a traced forward.

    ``input_ids`` itself for token-level losses (causal and masked LMs, token classifiers);
    one label per row for ``transformers``' sequence classifiers, as their ``problem_type``
    (or, unset, their ``num_labels``) says.
    """
    if not type(model).__name__.endswith(_SEQUENCE_CLASSIFIER_SUFFIX):
        return input_ids
    config = getattr(model, "config", None)
    num_labels = int(getattr(config, "num_labels", 2))
    problem_type = getattr(config, "problem_type", None)
    rows = input_ids.shape[0]
    if problem_type == "multi_label_classification":
        return torch.zeros(rows, num_labels, dtype=_float_dtype(model), device=input_ids.device)
    if problem_type == "regression" or (problem_type is None and num_labels == 1):
        shape = (rows,) if num_labels == 1 else (rows, num_labels)
        return torch.zeros(shape, dtype=_float_dtype(model), device=input_ids.device)
    return torch.zeros(rows, dtype=torch.long, device=input_ids.device)
