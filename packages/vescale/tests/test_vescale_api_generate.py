"""Generation and no-grad evaluation on the parallelized model, as one device runs them.

``model.generate(prompt)`` (``transformers``' greedy search, with and without its KV cache)
and an evaluation call under ``torch.no_grad()`` that reads the logits: under tensor
parallelism both used to fail with "aten.mul.Tensor got mixed torch.Tensor and DTensor" (the
logits are vocabulary-sharded DTensors). Reference: the tiny Llama built eagerly with the
same seed, one process. Compared: the generated tokens, exactly (greedy search takes an
argmax, so only a near-tie could move one: none here), and the evaluation logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
from vescale.dtensor.testing.models.token_batches import token_batches

GLOBAL_BATCH = 4
NEW_TOKENS = 8
# The logits of one forward, in float32: tensor-parallel partial sums add in another order.
LOGITS_BOUND = 1e-5


def _prompt() -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(0, tiny_hf_config("llama").vocab_size, (2, 6), generator=generator)


def _batch() -> dict[str, torch.Tensor]:
    return token_batches(tiny_hf_config("llama").vocab_size, 1, GLOBAL_BATCH, 8)[0]


def generate_on_rank(constraints: dict) -> tuple[list[torch.Tensor], torch.Tensor, str]:
    """Greedy generations (cache on, off), the no-grad evaluation logits and their type."""
    torch.manual_seed(0)
    model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, tiny_hf_config("llama"))
    plan = vescale.generate_plan(model, {**constraints, "global_batch_size": GLOBAL_BATCH})
    model, _, _, _ = vescale.parallelize(plan, model)
    model.eval()
    with torch.no_grad():
        generated = [
            model.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=use_cache)
            for use_cache in (True, False)
        ]
        logits = model(**_batch()).logits
    return generated, logits, type(logits).__name__


@pytest.mark.parametrize(
    ("constraints", "world_size"),
    [
        ({"tensor_parallel.size": 2}, 2),
        ({"tensor_parallel.size": 2, "sequence_parallel": True}, 2),
        ({"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 3}, 4),
    ],
    ids=["tp2", "tp2-sp", "dp2xtp2-zero3"],
)
def test_generate_and_no_grad_evaluation_give_what_one_device_gives(constraints, world_size):
    results = run_on_ranks(generate_on_rank, world_size=world_size, args=(constraints,), timeout_s=400)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(tiny_hf_config("llama")).eval()
    with torch.no_grad():
        expected = reference.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected_logits = reference(**_batch()).logits
    for generated, logits, logits_type in results:
        for tokens in generated:
            assert torch.equal(tokens, expected), (tokens, expected)
        assert logits_type == "Tensor", "the logits of a no-grad call are a plain tensor, as on one device"
        error = ((logits - expected_logits).abs().max() / expected_logits.abs().max()).item()
        assert error <= LOGITS_BOUND, error


def pipelined_attributes_on_rank() -> tuple[int, bool, str]:
    """A pipelined model's config, whether it offers generate, and what calling it says."""
    torch.manual_seed(0)
    model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, tiny_hf_config("llama"))
    plan = vescale.generate_plan(model, {"pipeline_parallel.size": 2, "global_batch_size": GLOBAL_BATCH})
    model, _, _, _ = vescale.parallelize(plan, model)
    try:
        model.generate(_prompt(), max_new_tokens=NEW_TOKENS)
    except AttributeError as error:
        return model.config.vocab_size, hasattr(model, "generate"), str(error)
    return model.config.vocab_size, hasattr(model, "generate"), "generate ran"


def test_a_pipelined_model_offers_its_config_and_refuses_generate_naming_the_way_out():
    for vocab_size, has_generate, message in run_on_ranks(pipelined_attributes_on_rank, world_size=2):
        assert vocab_size == tiny_hf_config("llama").vocab_size
        assert not has_generate
        assert message.startswith("LlamaForCausalLM.generate is not available on a pipelined model")
        assert "without pipeline_parallel" in message and "export-hf" in message
