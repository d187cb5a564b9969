"""Pipeline training is bitwise equal to single-process gradient accumulation.

Quantities compared: the loss returned on every rank after each AdamW step, and every
parameter after the last step. Reference: the same tiny model, seed and batches in one
process, in float32 with one thread, that for each step runs ``model(**micro_batch).loss
.backward()`` over the micro-batches in order 0..m-1 (PyTorch's pipeline schedules
accumulate the unscaled micro-batch losses' gradients in that order), then divides every
gradient by m once and steps AdamW; its loss is the sum of the m micro-batch losses
(stacked) divided by m. Pipeline stages run exactly the same operations on the same
values in the same order, so the untied Llama comparison is bitwise. GPT-2 ties ``wte`` to
``lm_head`` across the first and last stage: their gradients are summed across ranks in
another order than autograd's, so for GPT-2 the losses of every step and the first step's
gradients are compared within 1e-4 relative (float32 rounding of one reordered sum), and the
two tied copies bitwise to each other after the steps. GPT-2's parameters after AdamW are not
compared to the reference: its attention key bias has a mathematically zero gradient (softmax
ignores a shift shared by all keys), so its gradient is rounding noise (~1e-11) that AdamW
normalises into full learning-rate steps in whichever direction the noise points.
"""

from __future__ import annotations

import pytest
import torch

from vescale.dpipe import PipelinePlan, pipeline_parallelize
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model

STEPS = 3
BATCH_SIZE = 4
SEQ_LEN = 8


def _build(model_name: str) -> torch.nn.Module:
    if model_name == "gpt2":
        return build_tiny_hf_model("gpt2", n_layer=8, tie_word_embeddings=True)
    # Eight blocks: PP=4 with two virtual stages per rank needs eight stages.
    return build_tiny_hf_model("llama", num_hidden_layers=8)


def _batches(vocab_size: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(STEPS):
        input_ids = torch.randint(0, vocab_size, (BATCH_SIZE, SEQ_LEN), generator=generator)
        batches.append({"input_ids": input_ids, "labels": input_ids.clone()})
    return batches


def _named_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        fqn: p.grad.clone() for fqn, p in model.named_parameters(remove_duplicate=False) if p.grad is not None
    }


def _pipeline_run(model_name: str, plan_dict: dict) -> tuple[list, dict, dict]:
    plan = PipelinePlan.from_dict(plan_dict)
    model = _build(model_name)
    pipe = pipeline_parallelize(model, init_mesh(pp=plan.size), plan)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, first_gradients = [], {}
    for batch in _batches(model.config.vocab_size):
        out = pipe(**batch)
        out.loss.backward()
        first_gradients = first_gradients or _named_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.detach())
    parameters = {
        fqn: parameter.detach().clone() for fqn, parameter in model.named_parameters(remove_duplicate=False)
    }
    return losses, parameters, first_gradients


def _reference_run(model_name: str, num_microbatches: int) -> tuple[list, dict, dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _build(model_name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, first_gradients = [], {}
        for batch in _batches(model.config.vocab_size):
            micro_losses = []
            for index in range(num_microbatches):
                micro_batch = {name: value.chunk(num_microbatches)[index] for name, value in batch.items()}
                micro_loss = model(**micro_batch, use_cache=False).loss
                micro_loss.backward()
                micro_losses.append(micro_loss.detach())
            for parameter in model.parameters():
                parameter.grad.div_(num_microbatches)
            first_gradients = first_gradients or _named_gradients(model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(torch.stack(micro_losses).sum() / num_microbatches)
        parameters = {fqn: p.detach().clone() for fqn, p in model.named_parameters(remove_duplicate=False)}
        return losses, parameters, first_gradients
    finally:
        torch.set_num_threads(threads)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


PLANS = [
    pytest.param(2, dict(size=2, schedule="gpipe", num_microbatches=2), id="pp2-gpipe"),
    pytest.param(2, dict(size=2, schedule="1f1b", num_microbatches=4), id="pp2-1f1b"),
    pytest.param(4, dict(size=4, schedule="1f1b", num_microbatches=4), id="pp4-1f1b"),
    pytest.param(4, dict(size=4, schedule="gpipe", num_microbatches=2), id="pp4-gpipe"),
    # A manual cut after the blocks: stage 1 skips the embedding and all blocks, runs norm and head.
    pytest.param(
        2,
        dict(
            size=2, schedule="gpipe", num_microbatches=2, split_method="manual", split_points=["model.norm"]
        ),
        id="pp2-gpipe-cut-before-norm",
    ),
    pytest.param(
        2, dict(size=2, schedule="interleaved_1f1b", num_microbatches=4, virtual_stages=2), id="pp2-i1f1b"
    ),
    pytest.param(2, dict(size=2, schedule="zero_bubble", num_microbatches=4, virtual_stages=2), id="pp2-zb"),
    pytest.param(2, dict(size=2, schedule="zbv", num_microbatches=4, virtual_stages=2), id="pp2-zbv"),
    pytest.param(
        4, dict(size=4, schedule="interleaved_1f1b", num_microbatches=4, virtual_stages=2), id="pp4-i1f1b"
    ),
    pytest.param(4, dict(size=4, schedule="zbv", num_microbatches=4, virtual_stages=2), id="pp4-zbv"),
]


@pytest.mark.parametrize("world_size, plan_dict", PLANS)
def test_untied_llama_pipeline_is_bitwise_equal_to_accumulation(world_size: int, plan_dict: dict):
    results = run_on_ranks(_pipeline_run, world_size, args=("llama", plan_dict), timeout_s=90)
    expected_losses, expected_parameters, expected_gradients = _reference_run(
        "llama", plan_dict["num_microbatches"]
    )
    seen = set()
    for losses, parameters, gradients in results:
        for step, (loss, expected) in enumerate(zip(losses, expected_losses, strict=True)):
            assert torch.equal(loss, expected), f"step {step}: loss {loss.item()!r} != {expected.item()!r}"
        assert set(gradients) == set(parameters), "a parameter of this rank got no gradient"
        for fqn, gradient in gradients.items():
            assert torch.equal(gradient, expected_gradients[fqn]), f"first-step gradient of {fqn} differs"
        for fqn, parameter in parameters.items():
            assert torch.equal(parameter, expected_parameters[fqn]), f"parameter {fqn} differs"
            seen.add(fqn)
    assert seen == set(expected_parameters), f"no rank held {sorted(set(expected_parameters) - seen)}"


TIED_PLANS = [
    pytest.param(2, dict(size=2, schedule="1f1b", num_microbatches=2), id="pp2-1f1b"),
    pytest.param(4, dict(size=4, schedule="gpipe", num_microbatches=4), id="pp4-gpipe"),
    # ZBV puts the first and the last stage on rank 0: both copies are one parameter there.
    pytest.param(2, dict(size=2, schedule="zbv", num_microbatches=2, virtual_stages=2), id="pp2-zbv"),
]


@pytest.mark.parametrize("world_size, plan_dict", TIED_PLANS)
def test_tied_gpt2_pipeline_matches_accumulation_and_keeps_copies_identical(world_size: int, plan_dict: dict):
    results = run_on_ranks(_pipeline_run, world_size, args=("gpt2", plan_dict), timeout_s=90)
    expected_losses, _, expected_gradients = _reference_run("gpt2", plan_dict["num_microbatches"])
    for losses, _, gradients in results:
        for step, (loss, expected) in enumerate(zip(losses, expected_losses, strict=True)):
            assert _relative_error(loss, expected) < 1e-4, f"step {step}: {loss.item()} vs {expected.item()}"
        for fqn, gradient in gradients.items():
            error = _relative_error(gradient, expected_gradients[fqn])
            assert error < 1e-4, f"first-step gradient of {fqn}: relative error {error:.2e}"
    embedding = next(parameters["transformer.wte.weight"] for _, parameters, _ in results)
    head = next(p["lm_head.weight"] for _, p, _ in reversed(results) if "lm_head.weight" in p)
    assert torch.equal(embedding, head), "the tied copies of wte and lm_head drifted apart"
