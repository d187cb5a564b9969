"""``vescale train`` driven as a user drives it: 2 local ranks, resume, the single-device comparison
and its plot, and 2 "nodes" of 2 ranks each on this machine through torchrun's multi-node flags.

The reference is written here in plain PyTorch (not the command's own ``--compare-single-device``
code): the tiny-llama preset built after ``torch.manual_seed(0)``, AdamW with the command's
hyperparameters and warm-up, the pydoc text cut into 128-byte chunks taken in a seeded random
order, 32 per global batch. Each step runs the dp ranks' contiguous slices of the global batch in
rank order, autograd accumulating their gradients, divides them by dp once and steps: the
arithmetic of deterministic data parallelism (gradients summed in rank order), which
``--compare-single-device`` switches on. Ranks and reference run one thread each, so the loss
curves must be equal bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import torch
import transformers

from vescale.cli.models import PRESETS
from vescale.dtensor.testing._rank_pool import RANK_LOCK_ENV, _machine_wide_rank_lock

VESCALE = Path(sys.executable).parent / "vescale"

FIRST_STEPS, RESUMED_STEPS, MULTI_NODE_STEPS = 6, 3, 4
GLOBAL_BATCH, SEQUENCE = 32, 128
# The command's default model: the reference builds the same preset (one definition, the CLI's).
TINY_LLAMA = PRESETS["tiny-llama"].fields
# rich wraps no table cell the tests look for; one thread per rank, as the reference runs. The test
# holds the machine-wide rank lock around each job: the launcher's cpu calibration (MFU) runs under it.
ENVIRONMENT = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", RANK_LOCK_ENV: "none"}


def vescale_command(*arguments: str) -> list[str]:
    assert VESCALE.is_file(), f"{VESCALE} is missing: install the meta-package (bash tools/setup.sh)"
    return [str(VESCALE), *arguments]


def run_vescale(*arguments: str) -> subprocess.CompletedProcess:
    # Its ranks are real gloo processes: take the harness's machine-wide lock so that they never
    # start while another test's ranks are connecting.
    with _machine_wide_rank_lock():
        return subprocess.run(
            vescale_command(*arguments),
            capture_output=True,
            text=True,
            timeout=300,
            env=ENVIRONMENT,
            check=False,
        )


def run_tool(*arguments: str) -> subprocess.CompletedProcess:
    """A ``vescale`` command that starts no ranks (checkpoint tools): no rank lock needed."""
    return subprocess.run(
        vescale_command(*arguments), capture_output=True, text=True, timeout=300, env=ENVIRONMENT, check=False
    )


def reference_losses(steps: int, dp: int) -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: CPU matmuls differ between thread counts
    try:
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
            rank_losses = []
            for rank_rows in batch.chunk(dp):  # rank 0's slice first: autograd sums g_0 + g_1 + ...
                loss = model(input_ids=rank_rows, labels=rank_rows).loss
                loss.backward()
                rank_losses.append(loss.detach())
            for parameter in model.parameters():
                parameter.grad.div_(dp)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            # Every slice holds as many tokens: the global loss is the mean of the slices' losses.
            losses.append(float(torch.stack(rank_losses).to(torch.float64).mean().to(torch.float32)))
        return losses
    finally:
        torch.set_num_threads(threads)


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header (its signature and IHDR chunk checked on the way)."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", header
    return struct.unpack(">II", header[16:24])


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("train") / "tiny"
    completed = run_vescale(
        "train", "--nproc", "2", "--steps", str(FIRST_STEPS), "--checkpoint-dir", str(run_dir),
        "--compare-single-device", "--plot", str(run_dir.parent / "loss.png"),
    )  # fmt: skip
    return run_dir, completed


def test_train_resume_and_compare_follow_the_single_device_curve(first_run):
    run_dir, completed = first_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    output = completed.stdout
    assert output.count("vescale plan") == 1, "the plan table is printed by rank 0 only"
    assert "mesh                      pp=1  dp=2  ep=1  tp=1" in output
    assert "data-parallel gradients summed in rank order (deterministic)" in output
    assert f"done: {FIRST_STEPS} steps" in output and "tokens/s" in output
    reference = reference_losses(FIRST_STEPS + RESUMED_STEPS, dp=2)
    losses = json.loads((run_dir / "losses.json").read_text())["losses"]
    assert losses == reference[:FIRST_STEPS]  # bitwise: the same sums in the same order
    assert losses[-1] < losses[0] - 0.5, losses  # learning: ln(256) = 5.55 falls fast on text
    assert f"the curves are bitwise equal at all {FIRST_STEPS} steps" in output
    # The plot: a real PNG of the figure's 7 x 4 inches at matplotlib's 100 dpi, two curves' worth of bytes.
    plot = run_dir.parent / "loss.png"
    assert png_size(plot) == (700, 400) and plot.stat().st_size > 10_000
    assert f"loss curves drawn to {plot}" in output

    resumed = run_vescale(
        "train", "--nproc", "2", "--steps", str(RESUMED_STEPS), "--checkpoint-dir", str(run_dir), "--resume"
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {run_dir} at step {FIRST_STEPS}, last loss {losses[-1]:.4f}" in resumed.stdout
    assert "deterministic" not in resumed.stdout  # only --compare-single-device asks for it
    curve = json.loads((run_dir / "losses.json").read_text())
    assert curve["steps"] == list(range(1, FIRST_STEPS + RESUMED_STEPS + 1))
    assert curve["losses"][:FIRST_STEPS] == losses
    # Model, optimizer, schedule and data position all restored: the curve goes on as if never stopped.
    # Bitwise even without deterministic mode: an all-reduce of 2 ranks adds g_0 + g_1 in either
    # order, and IEEE addition is commutative.
    assert curve["losses"][FIRST_STEPS:] == reference[FIRST_STEPS:]


def free_port() -> int:
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_nodes_on_localhost_train_as_one_process_would(tmp_path):
    """torchrun's multi-node flags, as on two machines: the same command, each with its --node-rank.

    4 ranks in all, so the rank-ordered sum is what makes the curve bitwise (a 4-rank gloo ring
    all-reduce adds the ranks' gradients in another order for each chunk).
    """
    run_dir = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    arguments = (
        "train", "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint,
        "--steps", str(MULTI_NODE_STEPS), "--checkpoint-dir", str(run_dir), "--compare-single-device",
    )  # fmt: skip
    with _machine_wide_rank_lock():
        nodes = [
            subprocess.Popen(
                vescale_command(*arguments, "--node-rank", str(node_rank)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENVIRONMENT,
            )
            for node_rank in (0, 1)
        ]
        outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stdout + stderr
    node0, node1 = (stdout for stdout, _ in outputs)
    assert "on 4 ranks" in node0 and "mesh                      pp=1  dp=4  ep=1  tp=1" in node0
    assert f"the curves are bitwise equal at all {MULTI_NODE_STEPS} steps" in node0
    assert "vescale plan" not in node1 and "single-device" not in node1  # rank 0 and node 0 report
    losses = json.loads((run_dir / "losses.json").read_text())["losses"]
    assert losses == reference_losses(MULTI_NODE_STEPS, dp=4)


def test_checkpoint_of_a_run_shows_its_plan_and_exports(first_run, tmp_path):
    run_dir, completed = first_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    # The checkpoint tools start no ranks: both at once, outside the rank lock.
    with ThreadPoolExecutor(max_workers=2) as pool:
        inspecting = pool.submit(run_tool, "checkpoint", "inspect", str(run_dir))
        exporting = pool.submit(run_tool, "checkpoint", "export-hf", str(run_dir), str(tmp_path / "hf"))
        inspected, exported = inspecting.result(), exporting.result()
    assert inspected.returncode == 0, inspected.stderr
    assert "saved by 2 ranks" in inspected.stdout
    hidden, intermediate = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
    last = TINY_LLAMA["num_hidden_layers"] - 1
    assert f"model/model.layers.{last}.mlp.down_proj.weight" in inspected.stdout
    assert f"{hidden}x{intermediate}" in inspected.stdout
    assert (
        "saved plan:" in inspected.stdout and "data parallel             2, ZeRO-0 (DDP)" in inspected.stdout
    )
    assert exported.returncode == 0, exported.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # config.json copied beside
    assert model.config.hidden_size == hidden
    assert model.model.layers[last].mlp.down_proj.weight.shape == (hidden, intermediate)


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line_from_the_ranks(
    first_run, tmp_path, assert_one_line_error
):
    run_dir, _ = first_run
    narrow = tmp_path / "narrow.json"
    vocab, hidden = TINY_LLAMA["vocab_size"], TINY_LLAMA["hidden_size"]
    narrow.write_text(json.dumps({"model_type": "llama", **TINY_LLAMA, "hidden_size": hidden // 2}))
    # A user error met by the ranks is not retried (--max-restarts): one attempt, one line, exit 2.
    completed = run_vescale(
        "train", "--nproc", "2", "--steps", "1", "--checkpoint-dir", str(run_dir), "--resume",
        "--model", str(narrow), "--max-restarts", "2", "--save-every", "1",
    )  # fmt: skip
    assert_one_line_error(
        completed, "'model/lm_head.weight'", f"shape ({vocab}, {hidden})", f"shape ({vocab}, {hidden // 2})"
    )
