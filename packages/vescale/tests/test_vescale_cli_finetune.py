"""``vescale train`` as a fine-tuning job: a pretrained Hugging Face directory (weights + BPE tokenizer),
a JSONL corpus, 4 ranks, periodic async checkpoints, a held-out split, metrics.jsonl, TensorBoard, and
``checkpoint export-hf`` back to ``from_pretrained`` + ``AutoTokenizer`` + ``generate``.

The pretrained model is made here as a user would: a tiny Llama (the CLI's ``tiny-llama`` preset with
the tokenizer's vocabulary) trained a few steps in one process and saved with ``save_pretrained``,
beside a BPE ``tokenizer.json`` trained with ``tokenizers`` on the same kind of text. The reference
for the first step is ``from_pretrained(DIR)`` in one process on the run's first global batch,
rebuilt here in plain code from the tokenizer (documents encoded, EOS appended, packed, chunks in a
seeded order).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import torch
import transformers

from vescale.cli.models import PRESETS
from vescale.dtensor.testing._rank_pool import RANK_LOCK_ENV, _machine_wide_rank_lock

VESCALE = Path(sys.executable).parent / "vescale"
# The test holds the machine-wide rank lock around each job: the launcher's cpu calibration runs under it.
ENVIRONMENT = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", RANK_LOCK_ENV: "none"}
GLOBAL_BATCH, SEQUENCE, STEPS, SAVE_EVERY = 8, 64, 24, 10
# The run's batch shape and the bitwise-reproducible gradient sums (rank order).
CONSTRAINTS = {
    "global_batch_size": GLOBAL_BATCH,
    "sequence_length": SEQUENCE,
    "data_parallel.deterministic": True,
}


def documents() -> list[str]:
    return [topics[name] for name in sorted(topics)]


def train_tokenizer(path: Path) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(documents()[:60], trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    wrapped.save_pretrained(path)
    return wrapped


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A tiny Llama trained 5 steps in one process, saved with save_pretrained, with its tokenizer."""
    directory = tmp_path_factory.mktemp("pretrained") / "tiny-llama-bpe"
    tokenizer = train_tokenizer(directory)
    # The CLI's default preset (one definition), with the BPE tokenizer's vocabulary.
    config = transformers.LlamaConfig(**{**PRESETS["tiny-llama"].fields, "vocab_size": len(tokenizer)})
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor(tokenizer(documents()[0])["input_ids"][: 4 * SEQUENCE]).view(4, SEQUENCE)
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "topics.jsonl"
    path.write_text(
        "".join(json.dumps({"text": text, "id": index}) + "\n" for index, text in enumerate(documents()))
    )
    return path


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory) -> Path:
    """The same documents as the JSONL corpus, in a directory written by ``datasets``' save_to_disk."""
    import datasets

    path = tmp_path_factory.mktemp("dataset") / "topics"
    texts = documents()
    datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))}).save_to_disk(str(path))
    return path


def first_global_batch(pretrained: Path, corpus: Path) -> torch.Tensor:
    """The run's first global batch, rebuilt without the CLI: encode + EOS, pack, seeded chunk order."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(pretrained / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    ids: list[int] = []
    for line in corpus.read_text().splitlines():
        ids += [*tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids, eos]
    tokens = torch.tensor(ids)
    order = torch.randperm(len(tokens) // SEQUENCE, generator=torch.Generator().manual_seed(0))
    return torch.stack([tokens[chunk * SEQUENCE : (chunk + 1) * SEQUENCE] for chunk in order[:GLOBAL_BATCH]])


def free_port() -> int:
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_train(*arguments: str, timeout: float = 300) -> subprocess.CompletedProcess:
    with _machine_wide_rank_lock():
        return subprocess.run(
            [str(VESCALE), "train", *arguments],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=ENVIRONMENT,
            check=False,
        )


def finetune_arguments(pretrained: Path, corpus: Path, run_dir: Path) -> list[str]:
    """The fine-tuning job the restart tests repeat: 4 ranks, checkpoints every 10 steps, deterministic."""
    return [
        "--model", str(pretrained), "--data", str(corpus), "--nproc", "4", "--steps", str(STEPS),
        "--save-every", str(SAVE_EVERY), "--keep-last", "2", "--log-every", "1",
        "--constraints", json.dumps(CONSTRAINTS), "--checkpoint-dir", str(run_dir),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finetuned(pretrained, corpus, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("finetune") / "run"
    completed = run_train(
        *finetune_arguments(pretrained, corpus, run_dir),
        "--eval-every", "12", "--eval-fraction", "0.1", "--tensorboard", str(run_dir.parent / "tb"),
    )  # fmt: skip
    return run_dir, completed


def test_first_step_loss_is_from_pretrained_s_and_eval_is_reported(pretrained, corpus, finetuned):
    run_dir, completed = finetuned
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert f"weights: {pretrained}" in completed.stdout
    losses = json.loads((run_dir / "losses.json").read_text())["losses"]
    assert len(losses) == STEPS
    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    batch = first_global_batch(pretrained, corpus)
    with torch.no_grad():
        reference = float(model(input_ids=batch, labels=batch).loss)
    # 4 ranks' float32 losses summed in another order than one process's mean: ~1e-7 apart.
    print(f"first-step loss {losses[0]!r}, from_pretrained {reference!r}, relative error "
          f"{abs(losses[0] - reference) / reference:.2e}")  # fmt: skip
    assert abs(losses[0] - reference) / reference < 1e-5, (losses[0], reference)
    # Not the preset's random initialisation: the pretrained weights made this loss.
    torch.manual_seed(0)
    with torch.no_grad():
        fresh = float(transformers.LlamaForCausalLM(model.config)(input_ids=batch, labels=batch).loss)
    assert abs(fresh - reference) > 1e-3, (fresh, reference)
    entries = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [entry for entry in entries if "eval_loss" in entry]
    assert [entry["step"] for entry in evals] == [12, 24]
    print("eval:", [(entry["step"], round(entry["eval_loss"], 4)) for entry in evals])
    for entry in evals:
        assert entry["eval_perplexity"] == pytest.approx(math.exp(entry["eval_loss"]))
    assert f"step     12  eval loss {evals[0]['eval_loss']:.4f}" in completed.stdout
    # The .jsonl was tokenized once, by the launcher, into the cache beside it.
    assert len(list((corpus.parent / ".vescale-cache").glob("topics.jsonl.*.pt"))) == 1


def test_metrics_jsonl_and_tensorboard_carry_loss_tokens_per_s_and_mfu(finetuned):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, completed = finetuned
    assert completed.returncode == 0, completed.stdout + completed.stderr
    entries = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in entries if "loss" in entry]
    assert [entry["step"] for entry in steps] == list(range(1, STEPS + 1))  # --log-every 1
    for entry in steps:
        assert set(entry) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "max_memory_bytes"}
        assert entry["tokens_per_s"] > 0 and 0 < entry["mfu"] < 1 and entry["max_memory_bytes"] > 2**20
        assert entry["grad_norm"] > 0
    losses = json.loads((run_dir / "losses.json").read_text())["losses"]
    assert [entry["loss"] for entry in steps] == losses
    assert "MFU" in completed.stdout
    events = EventAccumulator(str(run_dir.parent / "tb"))
    events.Reload()
    for tag in ("train/loss", "train/tokens_per_s", "train/mfu", "train/lr", "train/grad_norm", "eval/loss"):
        assert tag in events.Tags()["scalars"], (tag, events.Tags())
    logged = {event.step: event.value for event in events.Scalars("train/loss")}
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert logged[STEPS] == pytest.approx(losses[-1], rel=1e-6)  # TensorBoard stores float32
    last = {tag: events.Scalars(f"train/{tag}")[-1].value for tag in ("loss", "tokens_per_s", "mfu")}
    print(f"metrics.jsonl step {STEPS}: {steps[-1]}; TensorBoard step {STEPS}: {last}")


def test_periodic_checkpoints_keep_the_last_two_and_latest(finetuned):
    run_dir, completed = finetuned
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert sorted(path.name for path in run_dir.glob("step-*")) == ["step-000020", "step-000024"]
    assert (run_dir / "latest").read_text().strip() == "step-000024"
    assert not list(run_dir.glob(".step-*"))  # no save left half-written


def test_export_hf_gives_from_pretrained_a_tokenizer_and_generate(finetuned, tmp_path):
    run_dir, completed = finetuned
    assert completed.returncode == 0, completed.stdout + completed.stderr
    out = tmp_path / "hf"
    exported = subprocess.run(
        [str(VESCALE), "checkpoint", "export-hf", str(run_dir), str(out)],
        capture_output=True,
        text=True,
        env=ENVIRONMENT,
        timeout=120,
        check=False,
    )
    assert exported.returncode == 0, exported.stderr
    assert "tokenizer.json" in exported.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("The for statement", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 8)
    assert isinstance(tokenizer.decode(generated[0]), str)


# --- surviving a dead or hung rank: the same job, one worker SIGKILLed or SIGSTOPped ---------------


def worker_pids(run_dir: Path) -> dict[int, int]:
    """The live train_worker processes of the run in ``run_dir``, by global rank (from their environment)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "vescale.cli.train_worker" in command and str(run_dir) in command:
            for variable in environment:
                if variable.startswith(b"RANK="):
                    pids[int(variable[5:])] = int(entry.name)
    return pids


class Job:
    """``vescale train`` started in the background (one or more "nodes"), its stdout read line by line."""

    def __init__(self, commands: list[list[str]], run_dir: Path) -> None:
        self.run_dir = run_dir
        environment = {**ENVIRONMENT, "PYTHONUNBUFFERED": "1"}
        self.processes = [
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
            )
            for command in commands
        ]
        self.lines: list[str] = []
        # stderr as (arrival time, line): the restart line's time is measured.
        self.errors: list[tuple[float, str]] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, sink), daemon=True)
            for process in self.processes
            for stream, sink in ((process.stdout, None), (process.stderr, self.errors))
        ]
        for reader in self._readers:
            reader.start()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Whatever happened in the test, leave no launcher or rank of this job running."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()  # the agent stops its ranks on SIGTERM
        for process in self.processes:
            try:
                process.wait(timeout=45)
            except subprocess.TimeoutExpired:
                process.kill()
        for pid in worker_pids(self.run_dir).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _read(self, stream, errors: list[tuple[float, str]] | None) -> None:
        for line in stream:
            if errors is None:
                self.lines.append(line)
            else:
                errors.append((time.monotonic(), line))

    def last_step(self, after: str | None = None) -> int:
        """The last step a "step N  loss" line reported so far (only lines after one starting ``after``)."""
        lines = list(self.lines)
        if after is not None:
            starts = [index for index, line in enumerate(lines) if line.startswith(after)]
            lines = lines[starts[0] :] if starts else []
        steps = [int(line.split()[1]) for line in lines if re.match(r"step +\d+  loss", line)]
        return steps[-1] if steps else 0

    def wait(self, timeout: float) -> tuple[list[int], str, str]:
        codes = [process.wait(timeout=timeout) for process in self.processes]
        for reader in self._readers:
            reader.join(timeout=10)
        return codes, "".join(self.lines), "".join(line for _, line in self.errors)


def wait_for(job: Job, condition, timeout: float, poll: float = 0.05) -> None:
    """Wait until ``condition()``; fail with the job's output if it ends or the time runs out first."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [process.poll() is not None for process in job.processes]
        if any(ended) or time.monotonic() > deadline:
            for process in job.processes:
                process.terminate()
            codes, stdout, stderr = job.wait(timeout=60)
            raise AssertionError(f"the job ended or timed out first ({codes}):\n{stdout}\n{stderr}")
        time.sleep(poll)


def assert_checkpoints_whole(run_dir: Path) -> None:
    """Every step-* directory has its index, and each file the index lists with its recorded size."""
    from vescale.dcheckpoint import read_index

    checkpoints = sorted(run_dir.glob("step-*"))
    assert checkpoints, list(run_dir.iterdir())
    for checkpoint in checkpoints:
        index = read_index(checkpoint)
        for name, record in index.files.items():
            assert (checkpoint / name).stat().st_size == record.size, (checkpoint, name)
    assert not list(run_dir.glob(".step-*")), list(run_dir.glob(".*"))


def assert_resumed_like_uninterrupted(
    finetuned, run_dir: Path, stdout: str, stderr: str, codes: list[int], killed_rank: int, killed_at: int
) -> int:
    """Check the restarted job against the uninterrupted one; return the step attempt 2 resumed from."""
    assert codes == [0] * len(codes), stdout + stderr
    assert (
        f"attempt 1 failed: rank {killed_rank} was killed by SIGKILL; restarting every rank (attempt 2 of 3)"
        in (stderr)
    )
    resumed = re.search(
        r"attempt 2: (?:resumed from .* at step (\d+)|no checkpoint was complete yet)", stdout
    )
    assert resumed is not None, stdout
    resumed_step = int(resumed.group(1) or 0)
    assert killed_at - resumed_step <= SAVE_EVERY, (killed_at, resumed_step)
    assert_checkpoints_whole(run_dir)
    reference = json.loads((finetuned[0] / "losses.json").read_text())["losses"]
    losses = json.loads((run_dir / "losses.json").read_text())
    assert losses["steps"] == list(range(1, STEPS + 1))
    assert losses["losses"] == reference  # bit for bit: rank-ordered sums, everything restored
    return resumed_step


def restart_arguments(pretrained: Path, corpus: Path, run_dir: Path) -> list[str]:
    return [
        *finetune_arguments(pretrained, corpus, run_dir), "--eval-every", "12", "--eval-fraction", "0.1",
        "--max-restarts", "2",
    ]  # fmt: skip


@pytest.mark.parametrize("trial", ["during-async-save", "two-nodes"])
def test_a_killed_worker_restarts_the_job_which_ends_as_if_uninterrupted(
    trial, pretrained, corpus, saved_dataset, finetuned, tmp_path
):
    assert finetuned[1].returncode == 0, finetuned[1].stdout + finetuned[1].stderr
    run_dir = tmp_path / "run"
    chooser = random.Random(f"{trial}-{os.getpid()}-{time.time_ns()}")
    # The two-node trial reads the corpus from a `datasets` directory: the same documents, so the same
    # tokens and the same curve as the JSONL run.
    arguments = restart_arguments(pretrained, saved_dataset if trial == "two-nodes" else corpus, run_dir)
    if trial == "two-nodes":
        endpoint = f"127.0.0.1:{free_port()}"
        # 2 nodes x 2 ranks: the same 4-rank world (a later --nproc wins over the job's --nproc 4).
        multi_node = ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint]
        commands = [
            [str(VESCALE), "train", *arguments, *multi_node, "--node-rank", str(node)] for node in (0, 1)
        ]
    else:
        commands = [[str(VESCALE), "train", *arguments]]
    with _machine_wide_rank_lock(), Job(commands, run_dir) as job:
        if trial == "during-async-save":
            # The save of step 20 runs on a background thread while the ranks train on: kill in it.
            saving = run_dir / ".step-000020.saving"
            wait_for(job, saving.exists, timeout=240, poll=0.0005)
        else:
            kill_step = chooser.randint(2, STEPS - 2)
            wait_for(job, lambda: job.last_step() >= kill_step, timeout=240)
        pids = worker_pids(run_dir)
        killed_rank = chooser.choice([rank for rank in sorted(pids) if trial != "two-nodes" or rank >= 2])
        during_save = (run_dir / ".step-000020.saving").exists()
        os.kill(pids[killed_rank], signal.SIGKILL)
        killed_at = job.last_step()
        codes, stdout, stderr = job.wait(timeout=300)
    if trial == "during-async-save":
        assert during_save, "the kill missed the save"
    resumed_step = assert_resumed_like_uninterrupted(
        finetuned, run_dir, stdout, stderr, codes, killed_rank, killed_at
    )
    print(
        f"{trial}: rank {killed_rank} SIGKILLed at step {killed_at} (during a save: {during_save}), exit "
        f"status {codes}, resumed at step {resumed_step}, {killed_at - resumed_step} step(s) lost, "
        f"checkpoints whole, loss curve bitwise equal to the uninterrupted run's"
    )


def test_a_worker_killed_at_a_random_step_then_one_stopped_each_restart_the_job(
    pretrained, corpus, finetuned, tmp_path
):
    """Attempt 1: a worker SIGKILLed at a random step. Attempt 2: a worker SIGSTOPped, which fails the
    attempt within --timeout with every rank's stack. Attempt 3 ends the run as if never interrupted.

    (One job for both failures: each costs the job a restart, not a new job of its own.)
    """
    assert finetuned[1].returncode == 0, finetuned[1].stdout + finetuned[1].stderr
    run_dir, timeout = tmp_path / "run", 10
    chooser = random.Random(f"kill-then-stop-{os.getpid()}-{time.time_ns()}")
    arguments = [*restart_arguments(pretrained, corpus, run_dir), "--timeout", str(timeout)]
    with _machine_wide_rank_lock(), Job([[str(VESCALE), "train", *arguments]], run_dir) as job:
        # Before step 13, so that attempt 2 (resumed at step 0 or 10) has steps left to stop in.
        kill_step = chooser.randint(2, 11)
        wait_for(job, lambda: job.last_step() >= kill_step, timeout=240)
        pids = worker_pids(run_dir)
        killed_rank = chooser.choice(sorted(pids))
        os.kill(pids[killed_rank], signal.SIGKILL)
        killed_at = job.last_step()
        wait_for(job, lambda: job.last_step(after="attempt 2:") >= 13, timeout=240)
        stopped_rank = chooser.choice(sorted(pids))
        stopped = worker_pids(run_dir)[stopped_rank]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(
            job,
            lambda: any(line.startswith("attempt 3: resumed") for line in job.lines),
            timeout=timeout + 90,
        )
        resumed_after = time.monotonic() - stopped_at
        codes, stdout, stderr = job.wait(timeout=300)
    resumed_step = assert_resumed_like_uninterrupted(
        finetuned, run_dir, stdout, stderr, codes, killed_rank, killed_at
    )
    stalled_at = [
        when for when, line in job.errors if when > stopped_at and "made no progress in step" in line
    ]
    # Not startswith: the stopped rank dumps its stack into the same stderr while the launcher reports,
    # and on a loaded machine the launcher's line can land after a partly written stack line.
    reported_at = [when for when, line in job.errors if "attempt 2 failed:" in line]
    assert stalled_at and reported_at, stderr
    failed_after, reported_after = stalled_at[0] - stopped_at, reported_at[0] - stopped_at
    print(
        f"random-step: rank {killed_rank} SIGKILLed at step {killed_at}, resumed at step {resumed_step}, "
        f"{killed_at - resumed_step} step(s) lost; then rank {stopped_rank} SIGSTOPped: attempt failed "
        f"(watchdog) {failed_after:.1f} s, launcher's line {reported_after:.1f} s, attempt 3 resumed "
        f"{resumed_after:.1f} s after the stop; exit status {codes}, checkpoints whole, loss curve bitwise "
        "equal to the uninterrupted run's"
    )
    # The three live ranks each print their stack in attempt 2: their own watchdog's message and
    # threads' stacks, or, when a peer's watchdog ended the attempt first, the traceback of the
    # collective that the peer's exit broke (the live ranks stall at different steps, so which of
    # the two each prints is a race; either names where the rank was).
    attempt_2 = stderr[stderr.index("attempt 1 failed") :]
    for rank in sorted(set(range(4)) - {stopped_rank}):
        watchdog = re.search(rf"error: rank {rank} made no progress in step \d+ for {timeout} s", attempt_2)
        traceback = re.search(rf"\[rank{rank}\]: Traceback \(most recent call last\)", attempt_2)
        assert watchdog or traceback, attempt_2
    assert re.search(rf"error: rank \d made no progress in step \d+ for {timeout} s", attempt_2), attempt_2
    # The stopped rank cannot: the launcher resumes it (SIGCONT) and has it print its stack (SIGUSR2).
    stopped_line = f"rank {stopped_rank} (pid {stopped}) is stopped (SIGSTOP); its Python stack:"
    assert stopped_line in stderr, stderr
    its_stack = stderr[stderr.index(stopped_line) :]
    assert "most recent call first" in its_stack and "train_worker.py" in its_stack, its_stack
    assert re.search(r"attempt 2 failed: rank \d made no progress within --timeout", stderr), stderr
    assert "attempt 3: resumed from" in stdout, stdout
    # The live ranks' watchdogs fail the attempt at the timeout (the step was already under way), and
    # the launcher's line follows at once: the stopped rank, resumed, ends at the agent's SIGTERM
    # instead of holding it through torchrun's 30 s grace.
    assert failed_after < timeout + 30, failed_after
    assert reported_after < timeout + 30, reported_after
    assert resumed_after < timeout + 30 + 60, resumed_after
