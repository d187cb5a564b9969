"""Layouts other components give their tensors: FSDP2's strided sharding over tensor
parallelism (ZeRO-3), and plain tensors that only some ranks hold (pipeline stages).

FSDP2 shards a tp-sharded dim within each tp shard: on a ``(dp, tp)`` mesh the rank at
``(d, t)`` holds ``chunk(chunk(full, tp)[t], dp)[d]`` (``torch.chunk`` both times), which its
DTensor states as ``(_StridedShard(0, sf=tp), Shard(0))``. The test builds exactly those local
tensors, checks that PyTorch's own ``full_tensor`` agrees that they form the full tensor (the
reading of the placements is PyTorch's, not ours), and then round-trips them through a
checkpoint into other layouts. Compared bitwise: saving and loading only move bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from vescale.dcheckpoint import load, save
from vescale.dcheckpoint.layout import TensorLayout
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.placements import distribute_tensor, to_torch_placements
from vescale.dtensor.testing import run_on_ranks

STRIDED = ["IS(0,2)", "S(0)"]


class Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def _fsdp_strided(full: torch.Tensor, mesh) -> DTensor:
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    local = full.chunk(mesh.size(1))[tp].chunk(mesh.size(0))[dp].clone()
    return DTensor.from_local(
        local, mesh, to_torch_placements(STRIDED), run_check=False, shape=full.shape, stride=full.stride()
    )


def _region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes, strict=True))


def strided_round_trip_on_ranks(directory: str, fulls: dict[str, torch.Tensor]) -> dict:
    device = device_type_for_backend(dist.get_backend())
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    strided = {name: _fsdp_strided(full, mesh) for name, full in fulls.items()}
    result = {"torch_agrees": torch.equal(strided["even"].full_tensor(), fulls["even"])}
    # Our boxes of each rank hold exactly its local tensor (uneven: dp chunks of 3 and 2 rows).
    result["boxes_match"] = all(
        torch.equal(
            tensor.to_local()[_region(b.local_offsets, b.box.sizes)],
            fulls[name][_region(b.box.offsets, b.box.sizes)],
        )
        for name, tensor in strided.items()
        for b in TensorLayout.of(tensor, 4).local_boxes(dist.get_rank())
    )
    save(f"{directory}/strided", {"model": Holder(strided)})
    flat = init_device_mesh(device, (4,))
    loaded = {name: distribute_tensor(torch.zeros_like(full), flat, ["S(1)"]) for name, full in fulls.items()}
    load(f"{directory}/strided", {"model": Holder(loaded)})
    result["loaded_elsewhere"] = all(torch.equal(loaded[n].full_tensor(), fulls[n]) for n in fulls)
    # And the other way: a dim-1 checkpoint into the strided layout.
    save(f"{directory}/flat", {"model": Holder(loaded)})
    into = {name: _fsdp_strided(torch.zeros_like(full), mesh) for name, full in fulls.items()}
    load(f"{directory}/flat", {"model": Holder(into)})
    expected = {name: _fsdp_strided(full, mesh) for name, full in fulls.items()}
    result["loaded_into_strided"] = all(
        torch.equal(into[n].to_local(), expected[n].to_local()) for n in fulls
    )
    return result


def test_fsdp2_strided_shards_over_tensor_parallel_save_and_load_in_any_layout(tmp_path):
    generator = torch.Generator().manual_seed(21)
    fulls = {
        "even": torch.randn(16, 6, generator=generator),
        "uneven": torch.randn(10, 6, generator=generator),
    }
    for rank, result in enumerate(run_on_ranks(strided_round_trip_on_ranks, 4, args=(str(tmp_path), fulls))):
        assert result == dict.fromkeys(result, True), (rank, result)


def load_own_stage_on_ranks(directory: str, fulls: dict[str, torch.Tensor]) -> dict:
    # Pipeline stages: rank r holds the plain tensor "stage<r>" only.
    name = f"stage{dist.get_rank()}"
    holder = Holder({name: torch.zeros_like(fulls[name])})
    stats = load(directory, {"model": holder}, strict=False).stats
    return {
        "equal": torch.equal(getattr(holder, name), fulls[name]),
        "bytes_read": stats.bytes_read,
        "bytes_received": stats.bytes_received,
    }


def test_a_plain_tensor_is_read_only_by_the_ranks_that_hold_it(tmp_path):
    generator = torch.Generator().manual_seed(22)
    # 2 and 1 MiB: a tensor taken for held by both ranks would be split between them (each
    # rank would read half of each, 1.5 MiB, and receive the other halves).
    rows = {0: 512, 1: 256}
    fulls = {f"stage{rank}": torch.randn(rows[rank], 1024, generator=generator) for rank in rows}
    save(tmp_path / "ckpt", {"model": Holder(fulls)})
    per_rank = run_on_ranks(load_own_stage_on_ranks, 2, args=(str(tmp_path / "ckpt"), fulls))
    for rank, result in enumerate(per_rank):
        assert result == {"equal": True, "bytes_read": rows[rank] * 1024 * 4, "bytes_received": 0}, result
