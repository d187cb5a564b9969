"""transformers' own activation checkpointing (``model.gradient_checkpointing_enable()``) under
``vescale.parallelize``.

Fine-tuning scripts turn it on before training; on a deferred model it must train as one
process does (recomputation changes no number). Reference: the tiny Llama built eagerly
with the same seed, one process, the same batch, without checkpointing. Compared after one SGD
step: every parameter's applied update (``(before - after) / lr``). A pipeline cannot run
reentrant checkpointing (PyTorch's stage backward differentiates with respect to the stage's
inputs): that is an error naming the two ways out, not torch's message about ``.grad()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers

import vescale
from vescale.dpipe import PipelineCheckpointingError
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
# Measured 4.9e-7 (tp2), 4.7e-7 (dp2 x tp2 ZeRO-3), 2.6e-7 (pp2): about the same as without
# checkpointing; a recomputed block whose gradient were lost or counted twice errs by 1.0.
BOUND = 1e-5


def _batch() -> dict[str, torch.Tensor]:
    return token_batches(tiny_hf_config("llama").vocab_size, 1, GLOBAL_BATCH, SEQ_LEN)[0]


def checkpointed_step_on_rank(
    constraints: dict, checkpointing_kwargs: dict | None
) -> tuple[dict, float, tuple[int, int]]:
    """One SGD step of the deferred Llama with transformers' checkpointing on: the updates, the
    loss, and how often the blocks were checkpointed and their MLPs ran (recomputations included)."""
    torch.manual_seed(0)
    model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, tiny_hf_config("llama"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
    assert model.is_gradient_checkpointing
    plan = vescale.generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH})
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.SGD(module.parameters(), lr=SGD_LR)
    )
    before = full_parameters(model)
    calls = _count_calls(innermost_module(model))
    loss = model(**_batch()).loss
    loss.backward()
    optimizer.step()
    after = full_parameters(model)
    updates = sgd_step_gradients(before, after, SGD_LR)
    return updates, loss.item(), (calls["checkpointed"], calls["mlp"])


def _count_calls(model: torch.nn.Module) -> dict[str, int]:
    """Counters of this rank's checkpointed block calls (transformers' ``_gradient_checkpointing_func``,
    which it calls once per block and forward) and of its blocks' MLP calls, counted as they start:
    a recomputation stops once it has rebuilt every saved tensor, inside the MLP's last
    projection, before a forward hook would run."""
    calls = {"checkpointed": 0, "mlp": 0}

    def count(*_: object) -> None:
        calls["mlp"] += 1

    def counted(function: Callable[..., Any]) -> Callable[..., Any]:
        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            calls["checkpointed"] += 1
            return function(*args, **kwargs)

        return checkpointed

    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False):
            module._gradient_checkpointing_func = counted(module._gradient_checkpointing_func)
        if name.endswith(".mlp"):
            module.register_forward_pre_hook(count)
    return calls


@pytest.mark.parametrize(
    ("constraints", "world_size"),
    [
        ({"tensor_parallel.size": 2}, 2),
        ({"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 3}, 4),
        ({"pipeline_parallel.size": 2}, 2),
    ],
    ids=["tp2", "dp2xtp2-zero3", "pp2"],
)
def test_transformers_gradient_checkpointing_trains_as_one_process(constraints, world_size):
    results = run_on_ranks(
        checkpointed_step_on_rank, world_size=world_size, args=(constraints, None), timeout_s=400
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama"))
    reference_loss = reference(**_batch()).loss
    reference_loss.backward()
    expected = {name: parameter.grad.double() for name, parameter in reference.named_parameters()}
    held: set[str] = set()
    for updates, loss, (checkpointed, mlp_calls) in results:
        assert abs(loss - reference_loss.item()) <= BOUND * abs(reference_loss.item())
        # Checkpointing really runs: the MLPs run again in the backward (a pipeline's first step
        # also runs PyTorch's shape inference without gradients, which recomputes nothing).
        assert checkpointed > 0 and mlp_calls > checkpointed, (checkpointed, mlp_calls)
        print(f"{constraints}: checkpointed blocks {checkpointed}, MLP calls {mlp_calls}")
        held |= set(updates)
        worst = assert_close_by_fqn(updates, {name: expected[name] for name in updates}, BOUND, "update")
        print(f"{constraints}: worst first-step update error {worst:.2e}")
    assert held == set(expected)


def test_reentrant_checkpointing_under_a_pipeline_names_the_cause_and_the_fix():
    with pytest.raises(
        PipelineCheckpointingError, match=r"LlamaForCausalLM runs reentrant .*use_reentrant=False"
    ):
        run_on_ranks(
            checkpointed_step_on_rank,
            world_size=2,
            args=({"pipeline_parallel.size": 2}, {"use_reentrant": True}),
            timeout_s=400,
        )
