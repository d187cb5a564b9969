"""The RFC's script on a deferred model converted before planning (``vescale.deferred_init(...).to(dtype)``).

``model.to(torch.bfloat16)`` and ``.double()`` are what a user does to a model before training
it; on a deferred model every conversion used to raise "Couldn't swap Embedding.weight".
Reference: the same Llama built eagerly with the same seed and converted the same way, one
process, the same batch. Compared after one SGD step of dp2 x tp2 ZeRO-3 (4 ranks): every
parameter's dtype and applied gradient (read back as ``(before - after) / lr``), and the loss.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
from vescale.dtensor.testing.models.token_batches import token_batches
from vescale.dtensor.testing.numerics import assert_close_by_fqn, full_parameters

SGD_LR = 1e3
GLOBAL_BATCH = 4
SEQ_LEN = 8
CONSTRAINTS = {
    "data_parallel.size": 2,
    "tensor_parallel.size": 2,
    "zero.stage": 3,
    "global_batch_size": GLOBAL_BATCH,
}


def _batch() -> dict[str, torch.Tensor]:
    return token_batches(tiny_hf_config("llama").vocab_size, 1, GLOBAL_BATCH, SEQ_LEN)[0]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=SGD_LR)


def converted_step_on_rank(dtype_name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.dtype], float]:
    """The RFC's script on ``deferred_init(...).to(dtype)``: applied gradients, dtypes and the loss."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, tiny_hf_config("llama"))
    model = model.to(dtype)
    plan = vescale.generate_plan(model, CONSTRAINTS)
    model, optimizer, _, _ = vescale.parallelize(plan, model, _sgd)
    before = full_parameters(model)
    dtypes = {name: value.dtype for name, value in before.items()}
    batch = _batch()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    after = full_parameters(model)
    gradients = {name: (before[name] - after[name]).double() / SGD_LR for name in after}
    return gradients, dtypes, loss.item()


@pytest.mark.parametrize(
    ("dtype_name", "bound"),
    [
        # float64: transformers computes Llama's loss in float32 (it upcasts the logits to float32,
        # not to float64), and the vocabulary-parallel loss sums in another order than one
        # process: measured 8.6e-8 worst (lm_head.weight). A materialisation in float32 fails the
        # dtype check; a doubled gradient errs by 1.0.
        ("float64", 1e-5),
        # bf16: every gradient rounds to 8 bits and tensor-parallel partial sums add in another
        # order than one process: measured 1.2e-2 worst (1.6 bf16 ulps); a doubled gradient errs
        # by 1.0.
        ("bfloat16", 5e-2),
    ],
)
def test_a_deferred_model_converted_to_another_dtype_trains_as_the_eager_model_converted_alike(
    dtype_name, bound
):
    dtype = getattr(torch, dtype_name)
    results = run_on_ranks(converted_step_on_rank, world_size=4, args=(dtype_name,), timeout_s=400)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")).to(dtype)
    reference_loss = reference(**_batch()).loss
    reference_loss.backward()
    expected = {name: parameter.grad.double() for name, parameter in reference.named_parameters()}
    for gradients, dtypes, loss in results:
        assert set(dtypes.values()) == {dtype}
        assert abs(loss - reference_loss.item()) <= bound * abs(reference_loss.item())
        worst = assert_close_by_fqn(gradients, expected, bound, "first-step gradient")
        print(f"{dtype_name}: worst first-step gradient error {worst:.2e}")
