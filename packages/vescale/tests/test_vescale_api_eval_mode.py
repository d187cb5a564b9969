"""A call of the parallelized model in eval mode with gradients on, as one device runs it.

``model.eval(); out = model(**batch)`` without ``torch.no_grad()`` (an evaluation loop that
forgot it, or training in eval mode to switch dropout off): one device runs a forward and
leaves the parameters' gradients alone until the caller's ``backward()``. With several
micro-batches per rank the parallelized model used to run each micro-batch's backward inside
the call, so every parameter got a gradient nobody asked for (all 21 of the tiny Llama's), which
the next training step then added to its own where the loop zeroes gradients after stepping.
Reference: the tiny Llama built eagerly with the same seed, in eval mode, one process, the
global batch. Compared: no gradient after the call; after ``loss.backward()`` and one SGD step,
every parameter's applied update.
"""

from __future__ import annotations

import torch
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
from vescale.dtensor.testing.models.token_batches import token_batches
from vescale.dtensor.testing.numerics import assert_close_by_fqn, full_parameters, sgd_step_gradients

SGD_LR = 1e3
GLOBAL_BATCH = 4
# Measured 2.2e-7 (dp2's gradient average adds in another order); a gradient counted twice
# (the call's own backward and the caller's) errs by 1.0.
BOUND = 1e-5


def _batch() -> dict[str, torch.Tensor]:
    return token_batches(tiny_hf_config("llama").vocab_size, 1, GLOBAL_BATCH, 8)[0]


def eval_mode_step_on_rank() -> tuple[int, int, dict[str, torch.Tensor], float]:
    """Micro-batches per rank, gradients after the call, then the caller's backward and SGD step."""
    torch.manual_seed(0)
    model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, tiny_hf_config("llama"))
    constraints = {"data_parallel.size": 2, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1}
    plan = vescale.generate_plan(model, constraints)
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.SGD(module.parameters(), lr=SGD_LR)
    )
    model.eval()
    rank, rows = torch.distributed.get_rank(), GLOBAL_BATCH // 2
    batch = {key: value[rank * rows : (rank + 1) * rows] for key, value in _batch().items()}
    before = full_parameters(model)
    loss = model(**batch).loss
    # Data parallelism may hold zero gradients in its buckets from the start: count nonzero ones.
    gradients = [parameter.grad for parameter in model.parameters()]
    with_gradient = sum(grad is not None and bool(grad.count_nonzero()) for grad in gradients)
    loss.backward()
    optimizer.step()
    after = full_parameters(model)
    updates = sgd_step_gradients(before, after, SGD_LR)
    return plan.num_microbatches, with_gradient, updates, loss.item()


def test_an_eval_mode_call_with_gradients_leaves_the_backward_to_the_caller():
    results = run_on_ranks(eval_mode_step_on_rank, world_size=2, timeout_s=400)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")).eval()
    reference_loss = reference(**_batch()).loss
    reference_loss.backward()
    expected = {name: parameter.grad.double() for name, parameter in reference.named_parameters()}
    for micro_batches, with_gradient, updates, loss in results:
        assert micro_batches == 2, "the case needs several micro-batches per rank"
        assert with_gradient == 0, f"{with_gradient} parameters got a gradient from a forward call"
        assert abs(loss - reference_loss.item()) <= BOUND * abs(reference_loss.item())
        worst = assert_close_by_fqn(updates, expected, BOUND, "first-step update")
        print(f"worst first-step update error {worst:.2e}")
