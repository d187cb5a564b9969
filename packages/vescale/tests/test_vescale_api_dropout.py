"""Dropout with its architecture's defaults under a cut batch: the masks of one device.

GPT-2's config drops 10% in its embedding, attention probabilities, attention output and MLP
output. One device draws each mask at the global batch's size; a dp rank or a micro-batch holds
some rows of it, and drew as if they were the whole batch (measured before the replay: first-step
losses 4.1692-4.1654 against 4.1736, gradients off by 0.73-0.86 relative, under dp2, tp2 with
micro-batches and pp2).

XLNet's activations are sequence-first (``[length, batch, hidden]``, its attention probabilities
``[length, length, batch, heads]``): a piece learns where its rows lie from a forward with its
rows doubled (measured before: losses 1e-3 to 1e-2 off by the first step under dp and pp).

Reference: the same tiny model (same seed) in one process, one forward and backward on the whole
global batch. Compared on every rank: the loss, the gradient every parameter was stepped with by
one SGD step, and the generator state after the step (the next step's draws start there).
Measured: losses equal to the reference or within 1.2e-7; gradients within 5.0e-7 relative
(GPT-2) and 8.8e-7 (XLNet), float32 reordering; a wrong mask moves a gradient by 1e-1 or more.
The gradients are read back from one SGD step at lr 1e6, so that the reading rounds at ~1e-7 of
the step itself: at lr 1e3 it rounded at ulp(parameter) / lr, 8.7e-6 of XLNet's largest gradient
(the reference read back against its own ``.grad``), too near the bound to tell anything.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers

import vescale
from vescale.api import _piece_random
from vescale.api.errors import NotSingleDeviceWarning
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm
from vescale.dtensor.testing.numerics import assert_close_by_fqn, full_parameters, sgd_step_gradients

SGD_LR = 1e6
GLOBAL_BATCH = 8
SEQUENCE = 16
VOCAB = 11
LOSS_BOUND = 1e-6
GRADIENT_BOUND = 1e-5


def build_gpt2(dropout: bool = True, hf_checkpointing: bool = False, layers: int = 2) -> torch.nn.Module:
    """A tiny GPT-2 with every default but its sizes: dropout 0.1 in four places (or none)."""
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=layers, n_head=4)
    assert (config.embd_pdrop, config.attn_pdrop, config.resid_pdrop) == (0.1, 0.1, 0.1)
    if not dropout:
        config.embd_pdrop = config.attn_pdrop = config.resid_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config).train()
    if hf_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def build_xlnet(dropout: bool = True, hf_checkpointing: bool = False) -> torch.nn.Module:
    """XLNet's tiny causal LM with every default but its sizes (dropout 0.1, sequence-first)."""
    assert dropout and not hf_checkpointing
    model = build_tiny_causal_lm("xlnet", seed=None)
    assert model.config.dropout == 0.1
    return model


BUILDERS = {
    "gpt2": build_gpt2,
    "gpt2-4-blocks": functools.partial(build_gpt2, layers=4),  # four stages, two per rank
    "xlnet": build_xlnet,
}


def batch() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, 64, (GLOBAL_BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return {"input_ids": input_ids, "labels": input_ids}


def step_on_rank(
    constraints: dict, dropout: bool = True, hf_checkpointing: bool = False, arch: str = "gpt2"
) -> tuple[float, dict, torch.Tensor]:
    vescale.manual_seed(0)
    model = vescale.deferred_init(BUILDERS[arch], dropout, hf_checkpointing)
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
        # Each stage starts from one device's state where its layers begin (vescale.dpipe.random_carry).
        ({"pipeline_parallel.size": 2}, 2),
        # One micro-batch: the whole batch, drawn as it is (a plain draw was sent to the sharded one).
        ({"pipeline_parallel.size": 2, "micro_batch_size": GLOBAL_BATCH}, 2),
        ({"pipeline_parallel.size": 2, "data_parallel.size": 2, "activation_checkpointing": "full"}, 4),
        # Tensor parallelism's local execution must not try a module that holds a stage's units:
        # its trial ran the stage boundary's generator entry out of turn (1.5e-3 on BlenderBot).
        ({"pipeline_parallel.size": 2, "tensor_parallel.size": 2}, 4),
        # Every axis at once: a dp rank's rows, cut into micro-batches, tensor-parallel masks in each.
        ({"pipeline_parallel.size": 2, "data_parallel.size": 2, "tensor_parallel.size": 2}, 8),
    ],
    ids=[
        "dp2",
        "tp2-micro-batches",
        "dp2-full-recompute",
        "dp2xtp2",
        "dp2-selective-recompute",
        "pp2",
        "pp2-one-micro-batch",
        "pp2xdp2-full-recompute",
        "pp2xtp2",
        "pp2xdp2xtp2",
    ],
)
def test_gpt2_default_dropout_matches_single_device(constraints, world_size):
    _assert_default_dropout_matches_single_device("gpt2", constraints, world_size)


def test_gpt2_default_dropout_matches_single_device_under_zbv():
    """Two stages per rank, the last rank running the second half's first stage and the first
    rank its last (ZBV's V shape), weight gradients apart from input gradients: each stage starts
    from one device's state where its layers begin, whichever rank holds it."""
    _assert_default_dropout_matches_single_device(
        "gpt2-4-blocks", {"pipeline_parallel.size": 2, "pipeline_parallel.schedule": "zbv"}, 2
    )


@pytest.mark.parametrize(
    ("constraints", "world_size"),
    [
        ({"data_parallel.size": 2}, 2),  # 4 micro-batches of 1 per dp rank
        ({"pipeline_parallel.size": 2}, 2),  # 8 micro-batches of 1
        ({"data_parallel.size": 2, "tensor_parallel.size": 2, "micro_batch_size": 2}, 4),
        # One piece per dp rank, its backward the caller's: the recomputed blocks draw again there.
        ({"data_parallel.size": 2, "micro_batch_size": 4, "activation_checkpointing": "full"}, 2),
    ],
    ids=["dp2", "pp2", "dp2xtp2", "dp2-full-recompute"],
)
def test_xlnet_sequence_first_dropout_matches_single_device(constraints, world_size):
    _assert_default_dropout_matches_single_device("xlnet", constraints, world_size)


def _assert_default_dropout_matches_single_device(arch: str, constraints: dict, world_size: int) -> None:
    torch.manual_seed(0)
    reference = BUILDERS[arch]()
    expected_loss = reference(**batch()).loss
    expected_state = torch.get_rng_state()
    expected_loss.backward()
    # Tied weights under both names: a pipeline's last stage holds GPT-2's as lm_head.weight.
    # A parameter the loss does not use (XLNet's mask_emb) has no gradient: SGD leaves it as it is.
    expected = {
        name: torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
        for name, parameter in reference.named_parameters(remove_duplicate=False)
    }
    covered: set[str] = set()
    for rank, (loss, gradients, state) in enumerate(
        run_on_ranks(step_on_rank, world_size, args=(constraints, True, False, arch), timeout_s=300)
    ):
        assert abs(loss - float(expected_loss)) <= LOSS_BOUND * abs(float(expected_loss)), (rank, loss)
        assert_close_by_fqn(
            gradients, {name: expected[name] for name in gradients}, GRADIENT_BOUND, f"rank {rank} gradient"
        )
        assert torch.equal(state, expected_state), f"rank {rank}: the generator is not where one device's is"
        covered |= set(gradients)
    # A pipeline's ranks hold every parameter between them.
    assert {name for name, _ in reference.named_parameters()} <= covered


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


def unreplayed_warnings_on_rank(dropout: bool) -> list[str]:
    _piece_random._WARNED.clear()  # warned once a process: this rank may have run other tests
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_on_rank({"data_parallel.size": 2, "micro_batch_size": 4}, dropout, hf_checkpointing=True)
    return [str(warning.message) for warning in caught if warning.category is NotSingleDeviceWarning]


def test_draws_that_cannot_be_replayed_say_so_on_every_rank():
    """Not covered: one piece per dp rank whose backward the caller runs through transformers' own
    (reentrant) checkpointing, whose recomputation cannot enter the replay. Every rank that drew
    warns once, naming the case and the way to compare (dropout 0); without dropout nothing warns."""
    for messages in run_on_ranks(unreplayed_warnings_on_rank, 2, args=(True,), timeout_s=300):
        assert len(messages) == 1, messages
        assert "gradient checkpointing" in messages[0] and "dropout to 0" in messages[0]
    for messages in run_on_ranks(unreplayed_warnings_on_rank, 2, args=(False,), timeout_s=300):
        assert messages == []
