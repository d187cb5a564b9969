"""Dropout with its architecture's defaults under a cut batch: the masks of one device.

GPT-2's config drops 10% in its embedding, attention probabilities, attention output and MLP
output. One device draws each mask at the global batch's size; a dp rank or a micro-batch holds
some rows of it, and drew as if they were the whole batch (measured before the replay: first-step
losses 4.1692-4.1654 against 4.1736, gradients off by 0.73-0.86 relative, under dp2, tp2 with
micro-batches and pp2).

Reference: the same tiny GPT-2 (same seed) in one process, one forward and backward on the whole
global batch. Compared on every rank: the loss, the gradient every parameter was stepped with by
one SGD step, and the generator state after the step (the next step's draws start there).
Measured: losses equal to the reference or within 1.2e-7; gradients within 5.0e-7 relative
(float32 reordering); a wrong mask moves a gradient by 1e-1 or more.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import assert_close_by_fqn, full_parameters, sgd_step_gradients

SGD_LR = 1e3
GLOBAL_BATCH = 8
SEQUENCE = 16
VOCAB = 11
LOSS_BOUND = 1e-6
GRADIENT_BOUND = 1e-5


def build_gpt2() -> torch.nn.Module:
    """A tiny GPT-2 with every default but its sizes: dropout 0.1 in four places."""
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    assert (config.embd_pdrop, config.attn_pdrop, config.resid_pdrop) == (0.1, 0.1, 0.1)
    return transformers.GPT2LMHeadModel(config).train()


def batch() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, 64, (GLOBAL_BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return {"input_ids": input_ids, "labels": input_ids}


def step_on_rank(constraints: dict) -> tuple[float, dict, torch.Tensor]:
    vescale.manual_seed(0)
    model = vescale.deferred_init(build_gpt2)
    plan = vescale.generate_plan(
        model, {"global_batch_size": GLOBAL_BATCH, "sequence_length": SEQUENCE, **constraints}
    )
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.SGD(module.parameters(), lr=SGD_LR)
    )
    mesh = vescale.api.parallelize.mesh_of(model)
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = GLOBAL_BATCH // dp_size
    before = full_parameters(model)
    loss = model(**{key: value[dp_rank * rows : (dp_rank + 1) * rows] for key, value in batch().items()}).loss
    loss.backward()
    optimizer.step()
    return float(loss), sgd_step_gradients(before, full_parameters(model), SGD_LR), torch.get_rng_state()


@pytest.mark.parametrize(
    ("constraints", "world_size"),
    [
        ({"data_parallel.size": 2}, 2),  # 4 micro-batches of 1 per dp rank
        ({"tensor_parallel.size": 2}, 2),  # 8 micro-batches of 1: tensor-parallel masks in each
        # One piece per dp rank, its backward the caller's: the recomputed blocks draw again there.
        ({"data_parallel.size": 2, "micro_batch_size": 4, "activation_checkpointing": "full"}, 2),
        (
            {"data_parallel.size": 2, "tensor_parallel.size": 2, "micro_batch_size": 2},
            4,
        ),
        (
            {"data_parallel.size": 2, "micro_batch_size": 4, "activation_checkpointing": "selective"},
            2,
        ),
    ],
    ids=["dp2", "tp2-micro-batches", "dp2-full-recompute", "dp2xtp2", "dp2-selective-recompute"],
)
def test_gpt2_default_dropout_matches_single_device(constraints, world_size):
    torch.manual_seed(0)
    reference = build_gpt2()
    expected_loss = reference(**batch()).loss
    expected_state = torch.get_rng_state()
    expected_loss.backward()
    expected = {name: parameter.grad for name, parameter in reference.named_parameters()}
    for rank, (loss, gradients, state) in enumerate(
        run_on_ranks(step_on_rank, world_size, args=(constraints,), timeout_s=300)
    ):
        assert abs(loss - float(expected_loss)) <= LOSS_BOUND * abs(float(expected_loss)), (rank, loss)
        assert_close_by_fqn(gradients, expected, GRADIENT_BOUND, f"rank {rank} gradient")
        assert torch.equal(state, expected_state), f"rank {rank}: the generator is not where one device's is"


class TokenTagger(torch.nn.Module):
    """A user's own model: an embedding, ``nn.Dropout``, a head and its own token cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.dropout = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.dropout(torch.relu(self.embed(input_ids))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tagger_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [
        {
            "input_ids": torch.randint(0, VOCAB, (GLOBAL_BATCH, 6), generator=generator),
            "labels": torch.randint(0, VOCAB, (GLOBAL_BATCH, 6), generator=generator),
        }
        for _ in range(3)
    ]


def tagger_losses_on_rank() -> list[float]:
    vescale.manual_seed(0)
    model = vescale.deferred_init(TokenTagger)
    plan = vescale.generate_plan(
        model, {"data_parallel.size": 2, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2}
    )
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.SGD(module.parameters(), lr=0.1)
    )
    rank = vescale.api.parallelize.mesh_of(model)["dp"].get_local_rank()
    losses = []
    for step, data in enumerate(tagger_batches()):
        if step == 1:
            model.dropout.p = 0.5  # switched on after a first call that drew nothing
        loss = model(**{key: value[rank * 4 : (rank + 1) * 4] for key, value in data.items()})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_dropout_switched_on_after_the_first_call_is_replayed_from_then_on():
    torch.manual_seed(0)
    reference = TokenTagger()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for step, data in enumerate(tagger_batches()):
        if step == 1:
            reference.dropout.p = 0.5
        loss = reference(**data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    for losses in run_on_ranks(tagger_losses_on_rank, 2, timeout_s=300):
        assert losses == pytest.approx(expected, rel=LOSS_BOUND)
