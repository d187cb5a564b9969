"""Data-dependent reads of DTensors inside a parallelized forward give the single-device values.

JetMoE's router calls ``counts.tolist()`` and LongCat-Flash's experts ``mask.nonzero()``; DTensor
refuses both on its own. Inside :class:`ReplicatePlainTensorsMode` a Replicate DTensor reads its
local values, a sharded one is gathered first; compared exactly with the plain tensor's answer.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from vescale.dtensor import init_mesh
from vescale.dtensor.implicit_replication import ReplicatePlainTensorsMode
from vescale.dtensor.testing import run_on_ranks


def reads_on_rank() -> dict:
    mesh = init_mesh(tp=2)
    values = torch.tensor([[0, 3], [2, 0], [0, 0], [5, 1]])
    results = {}
    for name, placements in (("replicate", [Replicate()]), ("shard", [Shard(0)])):
        dtensor = distribute_tensor(values, mesh, placements)
        with ReplicatePlainTensorsMode():
            listed = dtensor.tolist()
            found = dtensor.nonzero()
            found_fn = torch.nonzero(dtensor)
        results[name] = {
            "tolist": listed == values.tolist(),
            "nonzero": isinstance(found, DTensor) and torch.equal(found.full_tensor(), values.nonzero()),
            "torch.nonzero": torch.equal(found_fn.full_tensor(), torch.nonzero(values)),
        }
    return results


def test_tolist_and_nonzero_read_the_single_device_values():
    for rank, results in enumerate(run_on_ranks(reads_on_rank, world_size=2)):
        for name, checks in results.items():
            assert all(checks.values()), (rank, name, checks)
