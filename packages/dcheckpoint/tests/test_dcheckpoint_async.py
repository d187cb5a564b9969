"""Async saves: the checkpoint holds the state as it was when ``save`` returned, whatever the
caller does to the tensors afterwards (compared bitwise: saving and loading only move
bytes), collectives of the caller may run meanwhile, and memory does not grow save by save.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from vescale.dcheckpoint import AsyncSave, load, prepare_async_save, save
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.placements import distribute_tensor
from vescale.dtensor.testing import run_on_ranks


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 16))


def test_changes_after_an_async_save_returns_do_not_reach_the_checkpoint(tmp_path):
    model = _model(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pending = save(tmp_path / "step-1", {"model": model, "optimizer": optimizer}, async_save=True)
    assert isinstance(pending, AsyncSave)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    optimizer.param_groups[0]["lr"] = 0.5
    assert pending.result().path == tmp_path / "step-1"
    loaded = _model(2)
    loaded_optimizer = torch.optim.SGD(loaded.parameters(), lr=0.0)
    load(tmp_path, {"model": loaded, "optimizer": loaded_optimizer})
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert loaded_optimizer.param_groups[0]["lr"] == 0.1


def test_a_failed_async_save_raises_once_and_the_next_save_works(tmp_path):
    # The parent of the checkpoint is a file: the background save fails making its directory.
    (tmp_path / "blocked").write_text("not a directory")
    failing = save(tmp_path / "blocked" / "step-1", {"model": _model(1)}, async_save=True)
    with pytest.raises(OSError):
        failing.result()
    # The caller has had the error: the next save and load must not raise it again.
    model = _model(3)
    save(tmp_path / "ok" / "step-1", {"model": model}, async_save=True).result()
    loaded = _model(4)
    load(tmp_path / "ok", {"model": loaded})
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def async_save_while_training_on_ranks(directory: str, full: torch.Tensor) -> bool:
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), (dist.get_world_size(),))
    holder = nn.Module()
    holder.weight = nn.Parameter(distribute_tensor(full, mesh, ["S(0)"]), requires_grad=False)
    pending = save(directory, {"model": holder}, async_save=True)
    with torch.no_grad():
        holder.weight.to_local().mul_(-1)
    for _ in range(20):  # the caller's own collectives, on the default group, during the save
        value = torch.ones(1)
        dist.all_reduce(value)
    pending.result()
    fresh = nn.Module()
    fresh.weight = nn.Parameter(
        distribute_tensor(torch.zeros_like(full), mesh, ["S(1)"]), requires_grad=False
    )
    load(directory, {"model": fresh})
    return torch.equal(fresh.weight.full_tensor(), full) and value.item() == dist.get_world_size()


def test_async_save_on_ranks_runs_beside_the_callers_collectives(tmp_path):
    full = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    # Twice: each run has a new default process group, which needs a new group for the saving thread.
    for run in range(2):
        directory = str(tmp_path / f"ckpt-{run}")
        assert run_on_ranks(async_save_while_training_on_ranks, 2, args=(directory, full)) == [True, True]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_memory_is_stable_over_twenty_async_saves(tmp_path):
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))  # 8 MiB of parameters
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    resident = []
    for step in range(20):
        save(tmp_path / f"step-{step}", {"model": model}, async_save=True, keep_last=2).result()
        resident.append(_resident_bytes())
    # A staged copy kept alive per save would add state_bytes per save (15 x 8 MiB here).
    assert resident[-1] - resident[4] < state_bytes, [r >> 20 for r in resident]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-18", "step-19"]


def test_prepare_async_save_makes_the_first_async_save_allocate_nothing(tmp_path):
    # 24 MiB: larger than the staging memory earlier tests in this process reserved, so the
    # reservation is this test's own.
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(6)))
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert prepare_async_save({"model": model}) >= state_bytes
    resident = _resident_bytes()
    save(tmp_path / "step-1", {"model": model}, async_save=True).result()
    # Without the reservation the save would fault in a fresh state-sized buffer here.
    assert _resident_bytes() - resident < state_bytes / 4
    loaded = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(6)))
    load(tmp_path, {"model": loaded})
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


# The training loop's last save, and the process exits without waiting for it.
_SAVE_AND_EXIT = """
import sys, torch
from torch import nn
from vescale.dcheckpoint import save
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 16))
save(sys.argv[1], {"model": model}, async_save=True)
with torch.no_grad():
    for param in model.parameters():
        param.zero_()
"""


def test_a_process_that_exits_without_waiting_still_commits_its_async_save(tmp_path):
    subprocess.run([sys.executable, "-c", _SAVE_AND_EXIT, str(tmp_path / "step-1")], check=True, timeout=120)
    expected = _model(1)  # what the child built from the same seed, before it zeroed it
    loaded = _model(2)
    load(tmp_path, {"model": loaded})
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected.state_dict()[name]), name


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)  # a forward changes its buffers, unlike its parameters
        return self.linear(inputs)


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, torch.optim.AdamW])
def test_deferred_copies_hold_the_state_of_the_save_while_the_next_step_runs(
    tmp_path, optimizer_class, monkeypatch
):
    # defer_copies: the next forward/backward runs while the saving thread copies; the optimizer
    # step waits for the copies, so the checkpoint holds parameters, optimizer state and buffers
    # exactly as they were when save() was called (bitwise: saving and loading move bytes). The
    # saving thread starts its copies late, so that a step that did not wait would change them.
    from vescale.dcheckpoint import deferred_staging

    original_run = deferred_staging.DeferredCopies.run

    def late_run(self) -> None:
        time.sleep(0.3)
        original_run(self)

    monkeypatch.setattr(deferred_staging.DeferredCopies, "run", late_run)
    torch.manual_seed(0)
    model = _WithBuffer()
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    inputs = torch.randn(8, 256)
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    expected_model = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    expected_state = {
        (index, key): value.clone()
        for index, state in enumerate(optimizer.state.values())
        for key, value in state.items()
    }
    state = {"model": model, "optimizer": optimizer}
    pending = save(tmp_path / "step-1", state, async_save=True, defer_copies=True)
    for _ in range(2):  # steps that change every saved tensor, parameters first thing
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    pending.result()
    loaded = _WithBuffer()
    loaded_optimizer = optimizer_class(loaded.parameters(), lr=0.0)
    load(tmp_path, {"model": loaded, "optimizer": loaded_optimizer})
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected_model[name]), name
    for index, state in enumerate(loaded_optimizer.state.values()):
        for key, value in state.items():
            assert torch.equal(value, expected_state[(index, key)]), key
    assert not torch.equal(model.linear.weight, loaded.linear.weight)  # training did go on


def test_defer_copies_needs_an_async_save(tmp_path):
    from vescale.dcheckpoint.errors import CheckpointUsageError

    with pytest.raises(CheckpointUsageError, match="async_save=True"):
        save(tmp_path / "step-1", {"model": _model(1)}, defer_copies=True)
