"""Partial fine-tuning: parameters frozen (``requires_grad_(False)``) on the deferred model.

Freezing the embeddings or part of the base before training is what a user fine-tuning a
model does. The frozen parameters must stay frozen through every parallelism (no gradient,
no update, ``requires_grad`` still false), and the others must get the gradients one process
computes for the same frozen model. Reference: the tiny Llama built eagerly with the same
seed and frozen alike, one process, the same batch. Compared after one SGD step on 4 ranks:
every parameter's applied update (``(before - after) / lr``, zero for a frozen one).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
from vescale.dtensor.testing.models.token_batches import token_batches
from vescale.dtensor.testing.numerics import (
    assert_close_by_fqn,
    full_parameters,
    innermost_module,
    sgd_step_gradients,
)

SGD_LR = 1e3
GLOBAL_BATCH = 4
SEQ_LEN = 8
FROZEN = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")
# Measured 1.2e-7 (dp4), 4.7e-7 (dp2 x tp2 ZeRO-3) and 2.2e-7 (pp2 x dp2); a doubled or halved
# gradient errs by 1.0 or 0.5, and a frozen parameter updated after all by its full gradient.
BOUND = 1e-5


def _batch() -> dict[str, torch.Tensor]:
    return token_batches(tiny_hf_config("llama").vocab_size, 1, GLOBAL_BATCH, SEQ_LEN)[0]


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    for name, parameter in model.named_parameters():
        if name in FROZEN:
            parameter.requires_grad_(False)
    return model


def frozen_step_on_rank(constraints: dict) -> tuple[dict[str, torch.Tensor], set[str], float]:
    """One SGD step of the frozen deferred model: applied updates, frozen FQNs, the loss."""
    torch.manual_seed(0)
    model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, tiny_hf_config("llama"))
    plan = vescale.generate_plan(_frozen(model), {**constraints, "global_batch_size": GLOBAL_BATCH})
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.SGD(module.parameters(), lr=SGD_LR)
    )
    inner = innermost_module(model)
    frozen = {name for name, parameter in inner.named_parameters() if not parameter.requires_grad}
    before = full_parameters(model)
    loss = model(**_batch()).loss
    loss.backward()
    optimizer.step()
    after = full_parameters(model)
    return sgd_step_gradients(before, after, SGD_LR), frozen, loss.item()


@pytest.mark.parametrize(
    "constraints",
    [
        {"data_parallel.size": 4, "zero.stage": 2},
        {"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 3},
        {"pipeline_parallel.size": 2, "data_parallel.size": 2},
    ],
    ids=["dp4-zero2", "dp2xtp2-zero3", "pp2xdp2"],
)
def test_frozen_parameters_stay_frozen_and_the_others_train_as_one_process(constraints):
    results = run_on_ranks(frozen_step_on_rank, world_size=4, args=(constraints,), timeout_s=400)
    torch.manual_seed(0)
    reference = _frozen(transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")))
    reference_loss = reference(**_batch()).loss
    reference_loss.backward()
    expected = {
        name: (torch.zeros_like(parameter) if parameter.grad is None else parameter.grad).double()
        for name, parameter in reference.named_parameters()
    }
    assert all(expected[name].abs().max() == 0 for name in FROZEN)
    for updates, frozen, loss in results:
        assert abs(loss - reference_loss.item()) <= BOUND * abs(reference_loss.item())
        held = {name: expected[name] for name in updates}  # a pipeline rank: its stage's
        assert frozen == set(FROZEN) & set(held), frozen
        for name in frozen:
            assert torch.count_nonzero(updates[name]) == 0, f"{name} is frozen but moved"
        worst = assert_close_by_fqn(updates, held, BOUND, "first-step update")
        print(f"{constraints}: worst first-step update error {worst:.2e}")
    assert set().union(*(frozen for _, frozen, _ in results)) == set(FROZEN)
