"""Online resharding: every saved layout loads into every other, full tensors bitwise equal.

Layouts cover meshes (1), (2), (4) and (2, 2); Shard on dim 0 and 1, Replicate, uneven
shards (10 rows over 4 ranks, 7 elements over 4), two mesh dims sharding one tensor dim,
InterleavedShard on dim 0 and 1, and a plain (non-DTensor) scalar. The harness runs one
world size per call, so each layout saves in its own run and each load layout loads every
saved checkpoint in one run. Loading only moves bytes, so the reference (the global tensors
built in this process) must be matched bit for bit. Each rank must also read exactly the
bytes its shards hold: the reader reads only overlapping row runs, and the boxes that several
ranks hold (Replicate) are read by one of them and sent to the others, so bytes read plus
bytes received equal bytes needed, with no tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from vescale.dcheckpoint.api import load, save
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.placements import distribute_tensor, placement_to_string, to_vescale_placements
from vescale.dtensor.testing import run_on_ranks

# name -> global shape; "scalar" stays a plain tensor in every layout.
SHAPES = {"rows": (10, 6), "fused": (12, 9), "vector": (7,), "scalar": ()}

# (world size, mesh shape, {tensor: placements}); tensors not named are plain tensors.
LAYOUTS = {
    "mesh1": (1, (1,), {"rows": ["S(0)"], "fused": ["IS(0,3)"], "vector": ["R"]}),
    "mesh2-dim0": (2, (2,), {"rows": ["S(0)"], "fused": ["IS(0,3)"], "vector": ["S(0)"]}),
    "mesh2-dim1": (2, (2,), {"rows": ["S(1)"], "fused": ["IS(1,3)"], "vector": ["R"]}),
    "mesh4-uneven": (4, (4,), {"rows": ["S(0)"], "fused": ["IS(0,3)"], "vector": ["S(0)"]}),
    "mesh2x2-both-dims": (
        4,
        (2, 2),
        {"rows": ["S(0)", "S(1)"], "fused": ["R", "IS(0,3)"], "vector": ["S(0)", "S(0)"]},
    ),
    "mesh2x2-mixed": (4, (2, 2), {"rows": ["R", "S(1)"], "fused": ["S(1)", "IS(0,3)"], "vector": ["R", "R"]}),
}


def reference_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


class TensorHolder(nn.Module):
    """A module whose parameters are the given tensors (DTensors or plain)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def build_holder(mesh_shape, placements_by_name, fulls: dict[str, torch.Tensor]) -> TensorHolder:
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), mesh_shape)
    tensors = {
        name: distribute_tensor(full, mesh, placements_by_name[name])
        if name in placements_by_name
        else full.clone()
        for name, full in fulls.items()
    }
    return TensorHolder(tensors)


def save_layout_on_ranks(directory: str, mesh_shape, placements_by_name, fulls) -> list[str]:
    holder = build_holder(mesh_shape, placements_by_name, fulls)
    save(directory, {"model": holder})
    # What the DTensors really hold, so that the test knows InterleavedShard was exercised.
    return [
        f"{name}:{','.join(placement_to_string(p) for p in to_vescale_placements(param))}"
        for name, param in holder.named_parameters()
        if isinstance(param, DTensor)
    ]


def load_layout_on_ranks(directories: list[str], mesh_shape, placements_by_name, fulls) -> list[dict]:
    results = []
    for directory in directories:
        zeros = {name: torch.zeros_like(full) for name, full in fulls.items()}
        holder = build_holder(mesh_shape, placements_by_name, zeros)
        stats = load(directory, {"model": holder}).stats
        full_tensors = {
            name: param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
            for name, param in holder.named_parameters()
        }
        results.append(
            {
                "full": full_tensors,
                "bytes_read": stats.bytes_read,
                "bytes_needed": stats.bytes_needed,
                "bytes_received": stats.bytes_received,
            }
        )
    return results


def test_every_saved_layout_loads_bitwise_into_every_other_layout(tmp_path):
    fulls = reference_tensors()
    directories = {}
    for name, (world_size, mesh_shape, placements) in LAYOUTS.items():
        directories[name] = str(tmp_path / name)
        described = run_on_ranks(
            save_layout_on_ranks, world_size, args=(directories[name], mesh_shape, placements, fulls)
        )
        assert all(
            f"fused:{','.join(placements['fused'])}" in rank_description for rank_description in described
        )
    for load_name, (world_size, mesh_shape, placements) in LAYOUTS.items():
        per_rank = run_on_ranks(
            load_layout_on_ranks, world_size, args=(list(directories.values()), mesh_shape, placements, fulls)
        )
        for rank, results in enumerate(per_rank):
            for save_name, result in zip(directories, results, strict=True):
                case = f"saved {save_name} -> loaded {load_name} on rank {rank}"
                for tensor_name, full in fulls.items():
                    assert torch.equal(result["full"][tensor_name], full), f"{case}: {tensor_name}"
                assert result["bytes_read"] + result["bytes_received"] == result["bytes_needed"], case


@pytest.mark.parametrize("layout", ["mesh2-dim1", "mesh2x2-mixed"])
def test_saved_layout_loads_in_a_single_process_without_process_group(tmp_path, layout):
    world_size, mesh_shape, placements = LAYOUTS[layout]
    fulls = reference_tensors()
    run_on_ranks(
        save_layout_on_ranks, world_size, args=(str(tmp_path / "ckpt"), mesh_shape, placements, fulls)
    )
    holder = TensorHolder({name: torch.zeros_like(full) for name, full in fulls.items()})
    load(tmp_path / "ckpt", {"model": holder})
    for name, full in fulls.items():
        assert torch.equal(getattr(holder, name), full), name
