"""The RFC's training script through ``vescale.parallelize`` on 4 ranks trains like one device.

Each rank runs the RFC's script shape unchanged apart from the model and dataset:
``vescale.manual_seed``, ``vescale.deferred_init``, ``vescale.generate_plan(model, constraints)``,
``vescale.parallelize(plan, model, optimizer_fn, None, dataset)`` and the plain loop
``zero_grad / model(**batch).loss / backward / step``. Plans: dp4 (two micro-batches per rank,
so gradient accumulation too), tp4, dp2 x tp2 with sequence parallelism and ZeRO-2, and the
plan ``generate_plan`` chooses with no size constraint, for tiny ``transformers`` Llama, GPT-2
and Mixtral (its experts tensor-parallel, its router replicated).

Reference: plain PyTorch in one process (no veScale): the same model class, seed and config,
``torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH)``, the same AdamW, float32, one
thread. The labels of the samples are padded with -100 by different amounts (0-3 tokens), so
the dp slices and micro-batches hold unequal token counts: only token weighting gives the
reference's gradients (the test checks that training on the plain mean of
the four dp slices' mean losses misses the bound by more than 10x).

Compared quantity: the loss ``out.loss.item()`` of each of the 20 steps on every rank, which
must be the whole global batch's loss, against the reference's loss of that step. The runs
differ by float32 summation order (tp partial sums, dp/micro-batch accumulation, the weighted
sum of the pieces' losses), ~1e-7 relative per step, which AdamW amplifies over the steps;
the bound is the issue's 1e-4 relative (relative = |parallel - reference| / |reference|).
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers

import vescale
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config

LOSS_RTOL = 1e-4
STEPS = 20
GLOBAL_BATCH = 8
SEQ_LEN = 8
WORLD_SIZE = 4

CONSTRAINED_PLANS = {
    "dp4": {"data_parallel.size": 4, "micro_batch_size": 1},
    "tp4": {"tensor_parallel.size": 4, "micro_batch_size": GLOBAL_BATCH},
    "dp2xtp2+sp+zero2": {
        "data_parallel.size": 2,
        "tensor_parallel.size": 2,
        "sequence_parallel": True,
        "zero.stage": 2,
        "micro_batch_size": GLOBAL_BATCH // 2,
    },
    "generated": {},
}


def build_dataset(vocab_size: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for index in range(STEPS * GLOBAL_BATCH):
        input_ids = torch.randint(0, vocab_size, (SEQ_LEN,), generator=generator)
        labels = input_ids.clone()
        labels[SEQ_LEN - index % 4 :] = -100  # 0-3 padded positions: unequal token counts per piece
        samples.append({"input_ids": input_ids, "labels": labels})
    return samples


def optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def reference_losses(model_name: str) -> list[float]:
    torch.set_num_threads(1)
    config = tiny_hf_config(model_name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer = optimizer_fn(model)
    losses = []
    for batch in torch.utils.data.DataLoader(build_dataset(config.vocab_size), batch_size=GLOBAL_BATCH):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def unweighted_slices_losses(model_name: str) -> list[float]:
    """The reference's training with each step's loss the plain mean of 4 equal slices' mean losses.

    What dp4 without token weighting computes; the test checks it really differs from the reference.
    """
    torch.set_num_threads(1)
    config = tiny_hf_config(model_name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer = optimizer_fn(model)
    losses = []
    for batch in torch.utils.data.DataLoader(build_dataset(config.vocab_size), batch_size=GLOBAL_BATCH):
        optimizer.zero_grad()
        rows = GLOBAL_BATCH // WORLD_SIZE
        slices = [
            {key: value[i : i + rows] for key, value in batch.items()} for i in range(0, GLOBAL_BATCH, rows)
        ]
        loss = sum(model(**piece).loss for piece in slices) / len(slices)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def max_relative_error(losses: list[float], reference: list[float]) -> float:
    return max(abs(loss - expected) / abs(expected) for loss, expected in zip(losses, reference, strict=True))


def rfc_script_losses(model_name: str, plan_names: list[str]) -> dict[str, tuple[list[float], dict]]:
    """The RFC's script once per plan; returns each plan's per-step losses and mesh."""
    config = tiny_hf_config(model_name)
    dataset = build_dataset(config.vocab_size)
    results = {}
    for plan_name in plan_names:
        start = time.perf_counter()
        vescale.manual_seed(0)
        model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, config)
        constraints = {"global_batch_size": GLOBAL_BATCH, **CONSTRAINED_PLANS[plan_name]}
        plan = vescale.generate_plan(model, constraints)
        model, optimizer, _, data_loader = vescale.parallelize(plan, model, optimizer_fn, None, dataset)
        losses = []
        for batch in data_loader:
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        results[plan_name] = (losses, dict(plan.mesh), time.perf_counter() - start)
    return results


@pytest.mark.parametrize("model_name", ["llama", "gpt2", "mixtral"])
def test_rfc_script_on_4_ranks_matches_single_device_losses(model_name: str):
    plan_names = list(CONSTRAINED_PLANS)
    reference = reference_losses(model_name)
    # The padding must matter: without token weighting the losses would miss the bound by 10x.
    assert max_relative_error(unweighted_slices_losses(model_name), reference) > 10 * LOSS_RTOL
    results = run_on_ranks(
        rfc_script_losses, world_size=WORLD_SIZE, args=(model_name, plan_names), timeout_s=600
    )
    for rank, per_plan in enumerate(results):
        assert sorted(per_plan) == sorted(plan_names)
        for plan_name, (losses, mesh, seconds) in per_plan.items():
            assert len(losses) == STEPS, (plan_name, len(losses))
            worst = max_relative_error(losses, reference)
            if rank == 0:
                print(
                    f"{model_name} {plan_name} {mesh}: max relative loss error {worst:.2e} ({seconds:.1f} s)"
                )
            assert worst <= LOSS_RTOL, (model_name, plan_name, rank, losses, reference)
