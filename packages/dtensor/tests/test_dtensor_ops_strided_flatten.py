"""Flattening a ``_StridedShard`` dim into the dim before it gives the single-device view.

torch 2.13's view rule raises ``KeyError`` rewriting the strided placement when the dims
merge (Llama-4 under sequence parallelism: a (batch, seq, hidden) gradient with a strided
sequence shard reshaped to (tokens, hidden)); veScale's view strategy then gathers first.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import distribute_tensor

from vescale.dtensor import _compat, init_mesh
from vescale.dtensor.testing import run_on_ranks


def flatten_on_rank() -> dict:
    mesh = init_mesh(tp=2)
    torch.manual_seed(0)
    values = torch.randn(4, 16, 8)
    strided = distribute_tensor(values, mesh, [_compat.strided_shard_type()(1, split_factor=2)])
    flat = strided.reshape(64, 8)
    viewed = strided.view(64, 8)
    return {
        "input strided": "StridedShard" in type(strided.placements[0]).__name__,
        "reshape": torch.equal(flat.full_tensor(), values.reshape(64, 8)),
        "view": torch.equal(viewed.full_tensor(), values.view(64, 8)),
    }


def test_flattening_a_strided_shard_into_the_dim_before_matches_one_device():
    for rank, results in enumerate(run_on_ranks(flatten_on_rank, world_size=2)):
        assert all(results.values()), (rank, results)
