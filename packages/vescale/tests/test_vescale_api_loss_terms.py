"""The loss-term count behind every piece's weight: weighted piece losses add up to the batch's loss.

``vescale.parallelize`` weights each piece of a global batch (a dp rank's rows, a micro-batch,
pipelined or not) by its loss terms over the global count. That is one device's loss only if
the count is what the model's loss averages over. Checked here in one process on a padded
batch (rows padded by 0, 3, 1 and 5 tokens; two pieces of two rows): the weighted sum of the
pieces' losses equals the whole batch's loss (measured 0 to 1.3e-7 relative, float32, over all
172 causal-LM architectures of ``transformers`` 5.23 that run in one process, and masked LMs
and token classifiers of 7 encoders). Some models compute their own loss although their
``loss_function`` names the shifted causal-LM loss: ``BartForCausalLM`` averages the unshifted
labels, and the shifted count weighed its pieces 2.7e-4 of the loss off (the plain mean of the
pieces' means: 1.3e-3).
"""

from __future__ import annotations

import pytest
import torch

from vescale.api._token_weights import counts_tokens, loss_term_rule
from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm, tiny_causal_lm_batch

PADDING = [0, 3, 1, 5]  # padded tokens at the end of each of the batch's 4 rows
WEIGHTED_RTOL = 1e-6  # float32 rounding of the losses, measured up to 1.2e-7


def padded_pieces() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    input_ids, labels = tiny_causal_lm_batch(batch_size=4, seq_len=8)
    labels = labels.clone()
    for row, pads in enumerate(PADDING):
        if pads:
            labels[row, -pads:] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    return batch, [{name: value[start : start + 2] for name, value in batch.items()} for start in (0, 2)]


def losses(model: torch.nn.Module, batch, pieces) -> tuple[float, list[float]]:
    model.eval()  # no dropout: the pieces and the batch see the same function
    with torch.no_grad():
        return model(**batch).loss.double().item(), [model(**piece).loss.double().item() for piece in pieces]


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen3_moe", "gemma3_text"])
def test_counted_terms_weight_the_pieces_to_the_whole_batch_loss(model_type: str):
    model = build_tiny_causal_lm(model_type)
    assert counts_tokens(model)
    batch, pieces = padded_pieces()
    whole, piece_losses = losses(model, batch, pieces)
    counts = [loss_term_rule(model)(piece) for piece in pieces]
    assert [refused for _, refused in counts] == [False, False]
    terms = [count for count, _ in counts]
    assert terms == [11, 8]  # after the causal LM's one-token shift
    weighted = sum(count / sum(terms) * loss for count, loss in zip(terms, piece_losses, strict=True))
    assert weighted == pytest.approx(whole, rel=WEIGHTED_RTOL)
    assert sum(piece_losses) / 2 != pytest.approx(whole, rel=10 * WEIGHTED_RTOL)  # the padding matters


@pytest.mark.parametrize("model_type", ["bart", "xlnet", "xlm", "whisper"])
def test_a_model_computing_its_own_token_loss_counts_its_labels_unshifted(model_type: str):
    model = build_tiny_causal_lm(model_type)
    assert model.loss_function.__name__ == "ForCausalLMLoss"  # the name alone would count shifted labels
    batch, pieces = padded_pieces()
    counts = [loss_term_rule(model)(piece) for piece in pieces]
    assert counts == [(13, False), (10, False)]
    whole, piece_losses = losses(model, batch, pieces)
    terms = [count for count, _ in counts]
    weighted = sum(count / sum(terms) * loss for count, loss in zip(terms, piece_losses, strict=True))
    assert weighted == pytest.approx(whole, rel=WEIGHTED_RTOL)
    # The shifted count (what the name says) weighs the pieces wrongly.
    shifted = [int((piece["labels"][:, 1:] != -100).sum()) for piece in pieces]
    weighted = sum(count / sum(shifted) * loss for count, loss in zip(shifted, piece_losses, strict=True))
    assert weighted != pytest.approx(whole, rel=10 * WEIGHTED_RTOL)


def test_a_model_with_a_loss_of_its_own_kind_counts_rows_and_reports_padding():
    class OwnLoss(torch.nn.Module):  # no transformers loss function: vescale cannot know its terms
        def forward(self, input_ids, labels):
            raise NotImplementedError  # counting the terms does not run it

    _, pieces = padded_pieces()
    assert not counts_tokens(OwnLoss())
    assert [loss_term_rule(OwnLoss())(piece) for piece in pieces] == [(2, True), (2, True)]
