"""The pieces of ``vescale train`` that need no ranks: documents from text/JSONL/Parquet, the token cache,
EOS packing, the eval split, the step watchdog, the launcher's restart lines (and its stack dump of a
stopped rank, its refusal to retry a user error), the checkpoint finder.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from vescale.cli.data import ByteTextDataset, TokenDataset, default_text, split_for_eval, training_tokens
from vescale.cli.errors import CLIUsageError
from vescale.cli.restart_reports import RestartReporter, UserErrorStop, describe_exit, process_state
from vescale.cli.run_checkpoints import PeriodicCheckpoints, newest_checkpoint
from vescale.cli.text_corpus import CorpusSource, corpus_tokens, read_documents
from vescale.cli.watchdog import TIMEOUT_EXIT_CODE

DOCUMENTS = ["the first document", "a second one, longer than the first", "third"]


@pytest.fixture
def tokenizer_path(tmp_path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(DOCUMENTS * 4, trainers.BpeTrainer(special_tokens=["<unk>", "</s>"]))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def test_jsonl_parquet_and_text_give_the_same_documents(tmp_path):
    import pyarrow
    import pyarrow.parquet

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": text, "n": 1}) + "\n" for text in DOCUMENTS) + "\n")
    parquet = tmp_path / "docs.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"body": DOCUMENTS}), parquet)
    assert read_documents(str(jsonl), "body") == DOCUMENTS
    assert read_documents(str(parquet), "body") == DOCUMENTS
    (tmp_path / "one.txt").write_text("all of it")
    assert read_documents(str(tmp_path / "one.txt")) == ["all of it"]
    with pytest.raises(CLIUsageError, match=r"line 1 has no string field 'text'.*--text-field"):
        read_documents(str(jsonl))
    with pytest.raises(CLIUsageError, match=r"no column 'text' \(it has body\)"):
        read_documents(str(parquet))


def test_documents_are_tokenized_once_packed_with_eos_and_cached(tmp_path, tokenizer_path):
    from tokenizers import Tokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    tokens = corpus_tokens(CorpusSource(str(data), tokenizer_path), eos_token_id=None)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = tokenizer.token_to_id("</s>")
    expected = [i for text in DOCUMENTS for i in [*tokenizer.encode(text, add_special_tokens=False).ids, eos]]
    assert tokens.tolist() == expected
    cached = list((tmp_path / ".vescale-cache").glob("docs.jsonl.*.pt"))
    assert len(cached) == 1
    torch.save(torch.tensor([7, 7, 7]), cached[0])  # the cache is what is read back, not the data
    assert corpus_tokens(CorpusSource(str(data), tokenizer_path)).tolist() == [7, 7, 7]
    data.write_text(json.dumps({"text": "changed"}) + "\n")  # a new file hash: a new cache entry
    assert corpus_tokens(CorpusSource(str(data), tokenizer_path)).tolist() != [7, 7, 7]
    assert len(list((tmp_path / ".vescale-cache").glob("docs.jsonl.*.pt"))) == 2


def test_a_datasets_directory_gives_the_same_documents_and_tokens_cached_beside_it(tmp_path, tokenizer_path):
    import datasets

    saved = tmp_path / "docs"
    datasets.Dataset.from_dict({"body": DOCUMENTS, "n": [1, 2, 3]}).save_to_disk(str(saved))
    assert read_documents(str(saved), "body") == DOCUMENTS
    splits = tmp_path / "splits"  # a DatasetDict: its train split
    datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"body": ["held out"]}),
            "train": datasets.load_from_disk(saved),
        }
    ).save_to_disk(str(splits))
    assert read_documents(str(splits), "body") == DOCUMENTS
    with pytest.raises(CLIUsageError, match=r"no column 'text' \(it has body, n\)"):
        read_documents(str(saved))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": text}) + "\n" for text in DOCUMENTS))
    tokens = corpus_tokens(CorpusSource(str(saved), tokenizer_path, "body"))
    assert tokens.tolist() == corpus_tokens(CorpusSource(str(jsonl), tokenizer_path, "body")).tolist()
    # Cached beside the directory (inside it, the cache would change the directory's hash every time).
    cached = [path for path in (tmp_path / ".vescale-cache").glob("docs.*.pt") if ".jsonl." not in path.name]
    assert len(cached) == 1 and not (saved / ".vescale-cache").exists()
    torch.save(torch.tensor([7, 7]), cached[0])
    assert corpus_tokens(CorpusSource(str(saved), tokenizer_path, "body")).tolist() == [7, 7]


def test_bytes_stay_the_default_and_the_eval_split_keeps_the_training_order():
    tokens = training_tokens(None, None, "text", None)
    default = ByteTextDataset(default_text(), 128, seed=0)
    dataset = TokenDataset(tokens, 128, seed=0)
    assert dataset.order == default.order and torch.equal(dataset[5]["input_ids"], default[5]["input_ids"])
    train, held_out = split_for_eval(dataset, 0.05)
    assert len(held_out) == round(len(dataset) * 0.05) and len(train) + len(held_out) == len(dataset)
    assert train.order == dataset.order[: len(train)]  # the first global batches are unchanged
    assert not set(train.order) & set(held_out.order)
    with pytest.raises(CLIUsageError, match=r"--eval-fraction 1\.5"):
        split_for_eval(dataset, 1.5)


def test_newest_complete_checkpoint_and_when_saves_are_due(tmp_path):
    assert newest_checkpoint(tmp_path) is None
    for step, complete in ((10, True), (20, True), (30, False)):
        (tmp_path / f"step-{step:06d}").mkdir()
        if complete:
            (tmp_path / f"step-{step:06d}" / "index.json").write_text("{}")
    (tmp_path / ".step-000040.saving").mkdir()
    assert newest_checkpoint(tmp_path) == (20, tmp_path / "step-000020")
    saver = PeriodicCheckpoints(tmp_path, save_every=10, keep_last=None, end_step=25)
    assert [step for step in range(1, 26) if saver.due(step)] == [10, 20, 25]
    assert [s for s in range(1, 26) if PeriodicCheckpoints(tmp_path, 0, None, 25).due(s)] == [25]


def test_a_stalled_step_prints_the_stacks_and_exits_with_the_timeout_status(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            from vescale.cli.watchdog import StepWatchdog

            def waiting_for_a_peer():
                time.sleep(60)

            with StepWatchdog(timeout_s=1, rank=3) as watchdog:
                watchdog.arm(1)
                watchdog.arm(2)   # re-armed: step 1's countdown is over
                waiting_for_a_peer()
            """
        )
    )
    completed = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == TIMEOUT_EXIT_CODE, completed.stderr
    assert "error: rank 3 made no progress in step 2 for 1 s (--timeout)" in completed.stderr
    assert "waiting_for_a_peer" in completed.stderr and "most recent call first" in completed.stderr


def test_the_launcher_names_the_dead_rank_and_the_next_attempt(capsys):
    reporter = RestartReporter(node_rank=1, nproc=2, max_restarts=2)

    def record(message: str, *arguments: object) -> logging.LogRecord:
        return logging.LogRecord("torch", logging.INFO, __file__, 1, message, arguments, None)

    reporter.emit(record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", -9, 1, 123, "x"))
    reporter.emit(
        record("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "d", "F", 2, 2)
    )
    assert capsys.readouterr().err.strip() == (
        "attempt 1 failed: rank 3 was killed by SIGKILL; restarting every rank (attempt 2 of 3), "
        "resuming from the newest complete checkpoint"
    )
    assert describe_exit(TIMEOUT_EXIT_CODE).startswith("made no progress within --timeout")
    assert describe_exit(1) == "exited with status 1 (its traceback is above)"


def _record(message: str, *arguments: object) -> logging.LogRecord:
    return logging.LogRecord("torch", logging.WARNING, __file__, 1, message, arguments, None)


def test_a_stopped_rank_prints_its_stack_before_the_agent_ends_it(tmp_path, capsys):
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from vescale.cli.watchdog import register_stack_dump

            def waiting_in_a_collective():
                register_stack_dump()
                print("ready", flush=True)
                time.sleep(60)

            waiting_in_a_collective()
            """
        )
    )
    environment = {**os.environ, "RANK": "5"}
    rank = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    try:
        assert rank.stdout.readline().strip() == "ready"
        os.kill(rank.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(rank.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(rank.pid) in ("T", "t")
        reporter = RestartReporter(node_rank=0, nproc=8, max_restarts=1, run_dir=tmp_path)
        started = time.monotonic()
        reporter.emit(_record("Sending process %s closing signal %s", rank.pid, "SIGTERM"))
        rank.send_signal(signal.SIGTERM)  # what the agent does next: it ends at once, not after 30 s
        rank.wait(timeout=10)
        assert time.monotonic() - started < 5
    finally:
        rank.kill()
    _, stderr = rank.communicate()
    assert rank.returncode == -signal.SIGTERM
    assert "waiting_in_a_collective" in stderr and "most recent call first" in stderr, stderr
    assert (
        capsys.readouterr().err.strip() == f"rank 5 (pid {rank.pid}) is stopped (SIGSTOP); its Python stack:"
    )


def test_a_user_error_stops_the_agent_instead_of_a_restart(tmp_path, capsys):
    reporter = RestartReporter(node_rank=0, nproc=2, max_restarts=2, run_dir=tmp_path)
    reporter.emit(_record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 1, "x"))
    (tmp_path / "error.txt").write_text("error: --constraints: tp=3 does not divide 4 ranks")
    with pytest.raises(UserErrorStop, match="tp=3 does not divide"):
        reporter.emit(
            _record("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "d", "F", 2, 2)
        )
    assert "restarting" not in capsys.readouterr().err
