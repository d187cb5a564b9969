"""Ranks that hold different tensors (pipeline stages) save one checkpoint and load it in any split.

A hand-made 4-rank split on a ``(pp=2, tp=2)`` mesh: each pp row holds its own stage's
tensors (DTensors on its tp sub-mesh or on the whole mesh, and plain tensors), some tensors are
held by both rows on their own tp sub-meshes (a stage's dp replicas) and one plain tensor by every rank; one
tensor is cut differently by the two rows. Quantities compared, all bitwise (a checkpoint
only moves bytes): every tensor loaded by one process without a process group, and by two
ranks under another split, against the full tensors the saving ranks were built from
(deterministic per name, made independently of any parallel run). Dedup and balance: the
ranks together write exactly the checkpoint's tensor bytes (each box once), no rank more
than 1.1x the mean; the loading group reads at most 1.05x the bytes it needs.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.dcheckpoint import CheckpointMismatchError, load, read_index, save
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.testing import run_on_ranks

# name: (global shape, which pp rows hold it, how each row lays it out on its tp sub-mesh)
TENSORS = {
    "stage0_w": ((16, 8), (0,), (Shard(0),)),
    "stage0_b": ((16,), (0,), None),
    "stage1_w": ((8, 16), (1,), (Shard(1),)),
    "stage1_b": ((8,), (1,), None),
    "tied": ((12,), (0, 1), None),
    "rep": ((10,), (0, 1), (Replicate(),)),
    **{f"replica{index}_w": ((8, 8), (0, 1), (Shard(0),)) for index in range(12)},
}
# Cut along dim 0 by pp row 0 and along dim 1 by pp row 1; "stage0_full" is a DTensor on the whole
# (pp, tp) mesh, Replicate over pp, that only pp row 0 holds (dmodule's TP before dpipe's split).
MIXED = {"mixed": ((8, 8), (0, 1), None), "stage0_full": ((16, 8), (0,), None)}


def full_value(name: str) -> torch.Tensor:
    """The tensor's values, the same in every process (the reference)."""
    shape = {**TENSORS, **MIXED}[name][0]
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator)


class Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def _dtensor(full: torch.Tensor, mesh, placements) -> DTensor:
    local = full
    for placement in placements:
        if isinstance(placement, Shard):
            local = full.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
    return DTensor.from_local(local.clone(), mesh, placements, run_check=False)


def save_stages(path: str) -> int:
    """Rank function: this pp row's tensors on its tp sub-mesh; returns the bytes it wrote."""
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), (2, 2), mesh_dim_names=("pp", "tp"))
    pp_row, tp_mesh = mesh.get_local_rank("pp"), mesh["tp"]
    tensors = {}
    for name, (_, rows, placements) in TENSORS.items():
        if pp_row in rows:
            full = full_value(name)
            tensors[name] = full if placements is None else _dtensor(full, tp_mesh, placements)
    tensors["mixed"] = _dtensor(full_value("mixed"), tp_mesh, (Shard(pp_row),))
    if pp_row == 0:
        local = full_value("stage0_full").chunk(2, dim=0)[mesh.get_local_rank("tp")]
        placements = (Replicate(), Shard(0))
        tensors["stage0_full"] = DTensor.from_local(local.clone(), mesh, placements, run_check=False)
    return save(path, {"model": Holder(tensors)}).bytes_written


def load_other_split(path: str, holders_of_stage1_b: tuple[int, ...]) -> tuple[dict, float]:
    """Rank function: 2 ranks, every DTensor ``Shard(1)`` over both, plain ones split between them."""
    rank = dist.get_rank()
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), (2,))
    targets = {}
    for name in sorted({**TENSORS, **MIXED}):
        shape = full_value(name).shape
        if len(shape) == 2:
            targets[name] = _dtensor(torch.zeros(shape), mesh, (Shard(1),))
        elif name == "stage1_b":
            if rank in holders_of_stage1_b:
                targets[name] = torch.zeros(shape)
        elif zlib.crc32(name.encode()) % 2 == rank or name == "tied":
            targets[name] = torch.zeros(shape)
    try:
        stats = load(path, {"model": Holder(targets)}).stats
    except CheckpointMismatchError as error:
        return {"error": str(error)}, 0.0
    full = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in targets.items()}
    needed = torch.tensor([stats.bytes_read, stats.bytes_needed], dtype=torch.float64)
    dist.all_reduce(needed)
    return full, (needed[0] / needed[1]).item()


@pytest.fixture(scope="module")
def saved_stages(tmp_path_factory) -> tuple[str, list[int]]:
    path = str(tmp_path_factory.mktemp("rank_sets") / "step-1")
    return path, run_on_ranks(save_stages, 4, args=(path,), timeout_s=120)


def test_four_ranks_with_different_tensors_write_each_box_once_and_balanced(saved_stages):
    path, bytes_written = saved_stages
    index = read_index(Path(path))
    assert sorted(index.tensors) == sorted(f"model/{name}" for name in {**TENSORS, **MIXED})
    total = sum(full_value(name).numel() * 4 for name in {**TENSORS, **MIXED})
    assert sum(bytes_written) == total, bytes_written
    mean = total / len(bytes_written)
    assert max(bytes_written) <= 1.1 * mean, bytes_written


def test_one_process_loads_every_tensor_bitwise(saved_stages):
    path, _ = saved_stages
    names = sorted({**TENSORS, **MIXED})
    holder = Holder({name: torch.zeros(full_value(name).shape) for name in names})
    load(path, {"model": holder})
    for name in names:
        assert torch.equal(getattr(holder, name), full_value(name)), name


def test_two_ranks_load_another_split_bitwise_and_strictness_counts_every_rank(saved_stages):
    path, _ = saved_stages
    for full, read_ratio in run_on_ranks(load_other_split, 2, args=(path, (1,)), timeout_s=120):
        for name, tensor in full.items():
            assert torch.equal(tensor, full_value(name)), name
        assert read_ratio <= 1.05, read_ratio
    for error, _ in run_on_ranks(load_other_split, 2, args=(path, ()), timeout_s=120):
        assert error == {
            "error": "state['model'] does not match the checkpoint: missing none; unexpected "
            "'model/stage1_b'. Build the model the checkpoint was saved from, or pass strict=False"
        }
