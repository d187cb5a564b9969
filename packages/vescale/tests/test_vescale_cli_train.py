"""``vescale train`` driven as a user drives it: 2 local ranks, resume, the single-device comparison.

The reference is written here in plain PyTorch (not the command's own ``--compare-single-device``
code): the tiny-llama preset built after ``torch.manual_seed(0)``, AdamW with the command's
hyperparameters and warm-up, the pydoc text cut into 128-byte chunks taken in a seeded random
order, 32 per global batch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import torch
import transformers

from vescale.dtensor.testing._rank_pool import _machine_wide_rank_lock

VESCALE = Path(sys.executable).parent / "vescale"

FIRST_STEPS, RESUMED_STEPS = 6, 3
GLOBAL_BATCH, SEQUENCE = 32, 128
# The bound for the loss curves. dp=2 fp32 sums two half-batch gradients where one process
# takes one mean, so the losses differ by rounding (~1e-7 relative), grown by Adam over 9 steps.
LOSS_RTOL = 1e-4
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def run_vescale(*arguments: str) -> subprocess.CompletedProcess:
    assert VESCALE.is_file(), f"{VESCALE} is missing: install the meta-package (bash tools/setup.sh)"
    environment = {**os.environ, "COLUMNS": "200"}  # rich wraps no table cell the tests look for
    # Its ranks are real gloo processes: take the harness's machine-wide lock so that they never
    # start while another test's ranks are connecting.
    with _machine_wide_rank_lock():
        return subprocess.run(
            [str(VESCALE), *arguments],
            capture_output=True,
            text=True,
            timeout=300,
            env=environment,
            check=False,
        )


def assert_one_line_error(completed: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 2, one ``error:`` line on stderr naming the problem, no traceback from any rank."""
    assert completed.returncode == 2, (completed.returncode, completed.stdout, completed.stderr)
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), completed.stderr
    assert "Traceback" not in completed.stdout + completed.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def reference_losses(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    text = torch.tensor(list("\n\n".join(topics[name] for name in sorted(topics)).encode()))
    # The command's samples: the 128-byte chunks of the text in a seeded (seed 0) random order.
    order = torch.randperm(len(text) // SEQUENCE, generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(steps):
        chunks = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        batch = torch.stack([text[chunk * SEQUENCE : (chunk + 1) * SEQUENCE] for chunk in chunks])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def relative_difference(parallel: list[float], reference: list[float]) -> float:
    return max(abs(p - r) for p, r in zip(parallel, reference, strict=True)) / max(map(abs, reference))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("train") / "tiny"
    completed = run_vescale(
        "train", "--nproc", "2", "--steps", str(FIRST_STEPS), "--checkpoint-dir", str(run_dir),
        "--compare-single-device",
    )  # fmt: skip
    return run_dir, completed


def test_train_resume_and_compare_follow_the_single_device_curve(first_run):
    run_dir, completed = first_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    output = completed.stdout
    assert output.count("vescale plan") == 1, "the plan table is printed by rank 0 only"
    assert "mesh                      pp=1  dp=2  ep=1  tp=1" in output
    assert f"done: {FIRST_STEPS} steps" in output and "tokens/s" in output
    reference = reference_losses(FIRST_STEPS + RESUMED_STEPS)
    losses = json.loads((run_dir / "losses.json").read_text())["losses"]
    assert relative_difference(losses, reference[:FIRST_STEPS]) <= LOSS_RTOL
    assert losses[-1] < losses[0] - 0.5, losses  # learning: ln(256) = 5.55 falls fast on text
    printed = re.search(r"max relative difference over 6 steps: (\S+)", output)
    assert printed and float(printed.group(1)) <= LOSS_RTOL, output

    resumed = run_vescale(
        "train", "--nproc", "2", "--steps", str(RESUMED_STEPS), "--checkpoint-dir", str(run_dir), "--resume"
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {run_dir} at step {FIRST_STEPS}, last loss {losses[-1]:.4f}" in resumed.stdout
    curve = json.loads((run_dir / "losses.json").read_text())
    assert curve["steps"] == list(range(1, FIRST_STEPS + RESUMED_STEPS + 1))
    assert curve["losses"][:FIRST_STEPS] == losses
    # Model, optimizer, schedule and data position all restored: the curve goes on as if never stopped.
    assert relative_difference(curve["losses"][FIRST_STEPS:], reference[FIRST_STEPS:]) <= LOSS_RTOL


def test_checkpoint_of_a_run_shows_its_plan_and_exports(first_run, tmp_path):
    run_dir, completed = first_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    inspected = run_vescale("checkpoint", "inspect", str(run_dir))
    assert inspected.returncode == 0, inspected.stderr
    assert "saved by 2 ranks" in inspected.stdout
    assert "model/model.layers.3.mlp.down_proj.weight" in inspected.stdout and "128x344" in inspected.stdout
    assert (
        "saved plan:" in inspected.stdout and "data parallel             2, ZeRO-0 (DDP)" in inspected.stdout
    )
    exported = run_vescale("checkpoint", "export-hf", str(run_dir), str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # config.json copied beside
    assert model.config.hidden_size == 128 and model.model.layers[3].mlp.down_proj.weight.shape == (128, 344)


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line_from_the_ranks(first_run, tmp_path):
    run_dir, _ = first_run
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps({"model_type": "llama", **TINY_LLAMA, "hidden_size": 64}))
    completed = run_vescale(
        "train",
        "--nproc",
        "2",
        "--steps",
        "1",
        "--checkpoint-dir",
        str(run_dir),
        "--resume",
        "--model",
        str(narrow),
    )
    assert_one_line_error(completed, "'model/lm_head.weight'", "shape (256, 128)", "shape (256, 64)")
