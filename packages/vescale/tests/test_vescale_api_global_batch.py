"""The global-batch loss of a model whose loss vescale cannot weight per token (it counts rows).

A user's own model computing ``cross_entropy(..., ignore_index=-100)`` has no loss function that
vescale knows: its pieces are weighted by rows. Unpadded, that is exact: the loss every rank
returns is the whole global batch's, as one process computes it. Padded labels on any one dp
rank make the weighting wrong, so every rank refuses the call (one rank refusing alone would
leave the others hanging in the gradient reduction).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vescale
from vescale.api.errors import UnsupportedPlanError
from vescale.dtensor.testing import run_on_ranks

VOCAB = 11
ROWS = 4  # the global batch
SEQ = 6


class TokenClassifier(nn.Module):
    """Embedding, a block list, a head; its own token cross-entropy (mean over unpadded tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def global_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    return {"input_ids": input_ids, "labels": torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TokenClassifier()


def _dp2_losses(pad_rank: int | None, micro_batch_size: int) -> tuple[float | None, str]:
    model = build_model()
    constraints = {"data_parallel.size": 2, "global_batch_size": ROWS, "micro_batch_size": micro_batch_size}
    plan = vescale.generate_plan(model, constraints)
    model, _, _, _ = vescale.parallelize(plan, model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    rank = torch.distributed.get_rank()
    rows = ROWS // 2
    batch = {key: value[rank * rows : (rank + 1) * rows].clone() for key, value in global_batch().items()}
    if rank == pad_rank:
        batch["labels"][0, 3:] = -100
    try:
        return model(**batch).item(), ""
    except UnsupportedPlanError as error:
        return None, str(error)


# Each dp rank's 2 rows in one piece (one all-reduce after the forward), or in 2 micro-batches.
PIECES = pytest.mark.parametrize("micro_batch_size", [2, 1], ids=["one-piece", "micro-batches"])


@PIECES
def test_unpadded_rows_give_every_rank_the_global_batch_loss_of_one_process(micro_batch_size):
    expected = build_model()(**global_batch()).item()
    results = run_on_ranks(_dp2_losses, 2, args=(None, micro_batch_size))
    for loss, message in results:
        assert message == ""
        assert loss == pytest.approx(expected, rel=1e-6)


@PIECES
def test_padded_labels_on_one_rank_are_refused_on_every_rank(micro_batch_size):
    results = run_on_ranks(_dp2_losses, 2, args=(1, micro_batch_size))
    for loss, message in results:
        assert loss is None
        assert "labels padded with -100, but TokenClassifier's loss is not one whose terms" in message
