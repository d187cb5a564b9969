"""How many loss terms each micro-batch holds, so that losses and gradients weigh every token once.

A model's loss is the mean over the loss terms of its own input. When the global batch is cut
into dp slices and micro-batches, the mean of the pieces' means is the global mean only when
every piece holds as many terms; labels padded with ``-100`` break that. Each piece's loss is
therefore weighted by its term count over the global count (what ``vescale.parallelize`` does,
with a pipeline too); where the terms cannot be counted, padded labels are an error.

What a model's loss counts is read from the loss function ``transformers`` names for it where
its ``forward`` computes the loss with that function. A model of a token loss whose forward
computes its own cross-entropy counts its labels as given: 15 of ``transformers``' causal LMs
(``BartForCausalLM``, ``XLNetLMHeadModel``, ...) average unshifted labels although their
``loss_function`` names the shifted ``ForCausalLMLoss``; counted by the name, their padded
batches were weighted wrongly (1e-4 to 2e-3 of the loss, silently).

Example::

    rule = loss_term_rule(model)
    counts = [rule(micro_batch) for micro_batch in micro_batches]
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["IGNORE_INDEX", "LossTermRule", "counts_tokens", "loss_term_rule"]

IGNORE_INDEX = -100
"""The label value that ``torch.nn.functional.cross_entropy`` (and ``transformers``) skip."""

LossTermRule = Callable[[Mapping[str, Any]], tuple[int, bool]]
"""``rule(batch) -> (number of loss terms, whether that count cannot weight the batch's loss)``.

The second item is true for padded labels under a loss the rule does not know (it counts rows)."""


def _rows(batch: Mapping[str, Any]) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return 1


def _shifted_label_terms(batch: Mapping[str, Any]) -> tuple[int, bool]:
    # transformers' ForCausalLMLoss predicts token t+1 from t: the first label of a row is never a target.
    shift_labels = batch.get("shift_labels")
    targets = shift_labels if shift_labels is not None else batch["labels"][..., 1:]
    return int((targets != IGNORE_INDEX).sum()), False


def _label_terms(batch: Mapping[str, Any]) -> tuple[int, bool]:
    return int((batch["labels"] != IGNORE_INDEX).sum()), False


def _row_terms(batch: Mapping[str, Any]) -> tuple[int, bool]:
    labels = batch.get("labels")
    padded = isinstance(labels, torch.Tensor) and bool((labels == IGNORE_INDEX).any())
    return _rows(batch), padded


_TOKEN_LOSSES = {
    "ForCausalLMLoss": _shifted_label_terms,
    "ForMaskedLMLoss": _label_terms,
    "ForTokenClassification": _label_terms,
}


@functools.cache
def _forward_calls_loss_function(forward: Callable[..., Any]) -> bool:
    """Whether a model class's ``forward`` computes its loss with ``self.loss_function`` (by its source)."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in source


def _token_rule(model: nn.Module) -> LossTermRule | None:
    loss_function = getattr(model, "loss_function", None)
    rule = _TOKEN_LOSSES.get(getattr(loss_function, "__name__", ""))
    if rule is None or _forward_calls_loss_function(type(model).forward):
        return rule
    # A transformers model with a token loss of its own: a cross-entropy of its logits against
    # the labels as given (its causal LMs among them average unshifted labels), skipping -100.
    return _label_terms


def counts_tokens(model: nn.Module) -> bool:
    """Whether ``model``'s loss is one whose terms are counted per label (never refused as unweighted).

    Example::

        counts_tokens(LlamaForCausalLM(config))   # True: transformers' ForCausalLMLoss
    """
    return _token_rule(model) is not None


def loss_term_rule(model: nn.Module) -> LossTermRule:
    """The rule that counts ``model``'s loss terms in a batch.

    ``transformers`` models name their loss function: causal LMs count the labels after the
    one-token shift, masked LMs and token classifiers every label; both skip ``-100``. One whose
    forward computes such a loss itself (without ``self.loss_function``) counts every label.
    Any other model counts rows (a per-sample mean) and reports padded labels, which it cannot
    weight.

    Example::

        count, padded = loss_term_rule(model)({"input_ids": ids, "labels": labels})
    """
    token_rule = _token_rule(model)
    if token_rule is None:
        return _row_terms

    def count(batch: Mapping[str, Any]) -> tuple[int, bool]:
        return token_rule(batch) if isinstance(batch.get("labels"), torch.Tensor) else _row_terms(batch)

    return count
