"""Atomic saves: a save killed with SIGKILL at any step leaves every earlier checkpoint
loadable bit for bit, ``latest`` naming a complete checkpoint, and no half-written one.

Each kill runs in a forked child that patches one step of the save to SIGKILL itself there.
Loaded tensors are compared bitwise with the saved ones: loading only moves bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vescale.dcheckpoint.api import load, save
from vescale.dcheckpoint.errors import CheckpointNotFoundError, CheckpointUsageError

# The subprocess imports torch once, then forks one child per (kill point, root, keep_last):
# the child patches the step named by the point to SIGKILL itself, and saves model(2) to
# root/step-2. The parent prints each child's wait status.
KILLED_SAVES = """
import json, os, shutil, sys
import torch
from torch import nn
from vescale.dcheckpoint import api, atomic, saving, writer
from vescale.dtensor.testing.faults import kill_on_call

def save_killed_at(point, root, keep_last):
    if point == "mid-shard":       # after the first chunk's bytes, before the second's
        writer._write_piece = kill_on_call(2, writer._write_piece)
    elif point == "before-fsync":  # shard written, not yet fsynced
        atomic.fsync_file = kill_on_call(1, atomic.fsync_file)
    elif point == "before-index":
        saving.encode_index = kill_on_call(1, saving.encode_index)
    elif point == "before-rename":
        os.rename = kill_on_call(1, os.rename)
    elif point == "before-latest":
        atomic.update_latest = kill_on_call(1, atomic.update_latest)
    elif point == "mid-latest":    # pending pointer written, not yet renamed over `latest`
        os.replace = kill_on_call(1, os.replace)
    elif point == "mid-prune":     # old checkpoint renamed away, not yet deleted
        shutil.rmtree = kill_on_call(1, shutil.rmtree)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    api.save(os.path.join(root, "step-2"), {"model": model}, keep_last=keep_last or None)

statuses = {}
for point, root, keep_last in json.loads(sys.argv[1]):
    child = os.fork()
    if child == 0:
        save_killed_at(point, root, keep_last)
        os._exit(0)
    statuses[point] = os.waitpid(child, 0)[1]
print(json.dumps(statuses))
"""


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))


def _assert_holds(path: Path, seed: int) -> None:
    loaded = _model(seed + 1000)
    load(path, {"model": loaded})
    for (name, expected), value in zip(
        _model(seed).state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(expected, value), name


# (kill point, keep_last, does the new checkpoint exist afterwards, what `latest` names)
KILL_POINTS = [
    ("mid-shard", 0, False, "step-1"),
    ("before-fsync", 0, False, "step-1"),
    ("before-index", 0, False, "step-1"),
    ("before-rename", 0, False, "step-1"),
    ("before-latest", 0, True, "step-1"),
    ("mid-latest", 0, True, "step-1"),
    ("mid-prune", 1, True, "step-2"),
]


def test_a_save_killed_at_any_step_leaves_the_previous_checkpoint_loadable(tmp_path):
    previous_files = {}
    for point, *_ in KILL_POINTS:
        save(tmp_path / point / "step-1", {"model": _model(1)})
        previous_files[point] = {p.name: p.read_bytes() for p in (tmp_path / point / "step-1").iterdir()}
    jobs = [[point, str(tmp_path / point), keep_last] for point, keep_last, *_ in KILL_POINTS]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_SAVES, json.dumps(jobs)], capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == 0, killed.stderr
    statuses = json.loads(killed.stdout)
    for point, _, new_exists, latest in KILL_POINTS:
        root = tmp_path / point
        assert os.WIFSIGNALED(statuses[point]) and os.WTERMSIG(statuses[point]) == signal.SIGKILL, point
        assert (root / "latest").read_text().strip() == latest, point
        _assert_holds(root, seed=1 if latest == "step-1" else 2)
        if point != "mid-prune":
            assert {p.name: p.read_bytes() for p in (root / "step-1").iterdir()} == previous_files[point], (
                point
            )
            _assert_holds(root / "step-1", seed=1)
        if new_exists:
            _assert_holds(root / "step-2", seed=2)
        else:
            with pytest.raises(CheckpointNotFoundError):
                load(root / "step-2", {"model": _model(0)})
            # The next attempt at the same path succeeds: what the killed save left is cleared.
            save(root / "step-2", {"model": _model(2)})
            _assert_holds(root, seed=2)


def test_keep_last_keeps_the_newest_and_latest_follows(tmp_path):
    for step in range(1, 5):
        save(tmp_path / f"step-{step}", {"model": _model(step)}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "latest",
        "step-3",
        "step-4",
    ]
    _assert_holds(tmp_path, seed=4)
    _assert_holds(tmp_path / "step-3", seed=3)


def test_keep_last_below_one_is_refused(tmp_path):
    with pytest.raises(CheckpointUsageError, match=r"keep_last=0: keep at least the checkpoint just saved"):
        save(tmp_path / "step-1", {"model": _model(1)}, keep_last=0)
