"""Boolean masks (indexing, ``where``, ``masked_fill``) and ``index_add_`` of DTensors give the
single-device values.

X-MOD's ``hidden[lang_mask]`` and LongCat-Flash's ``torch.where(expert_mask)`` reach aten's
``nonzero`` below any Python mode; DTensor could not propagate them. LongCat-Flash's
``final.index_add_(0, token_idx, partial_output)`` into a Replicate tensor was relabelled
Partial by DTensor's decomposition path without changing the data (1.2e-3 off, silently).
Gemma-3n's ``masked_fill_(mask, 0)`` on a Partial tensor was refused; filling with zero keeps
the Partial sum. Each case is compared with the same op on plain tensors.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks


def index_cases_on_rank() -> dict:
    mesh = init_mesh(tp=2)
    torch.manual_seed(0)
    results = {}
    x = torch.randn(5, 4)
    mask = torch.tensor([True, False, True, True, False])
    sharded_x = distribute_tensor(x, mesh, [Shard(1)])
    replicated_mask = distribute_tensor(mask, mesh, [Replicate()])
    results["mask index of a column-sharded tensor"] = torch.equal(
        sharded_x[replicated_mask].full_tensor(), x[mask]
    )
    results["mask index with a sharded mask"] = torch.equal(
        distribute_tensor(x, mesh, [Replicate()])[distribute_tensor(mask, mesh, [Shard(0)])].full_tensor(),
        x[mask],
    )
    grid = torch.tensor([[True, False, True], [False, False, True]])
    rows, columns = torch.where(distribute_tensor(grid, mesh, [Replicate()]))
    plain_rows, plain_columns = torch.where(grid)
    results["torch.where of a mask"] = torch.equal(rows.full_tensor(), plain_rows) and torch.equal(
        columns.full_tensor(), plain_columns
    )

    base, source, index = torch.randn(6, 4), torch.randn(3, 4), torch.tensor([0, 2, 5])
    expected = base.clone().index_add_(0, index, source)
    replicated = distribute_tensor(base.clone(), mesh, [Replicate()])  # may share base's memory
    rank_share = source / 2  # the two ranks' Partial pieces sum to the source
    partial_source = DTensor.from_local(rank_share, mesh, [Partial()], run_check=False)
    replicated.index_add_(0, distribute_tensor(index, mesh, [Replicate()]), partial_source)
    results["index_add_ of a Partial source into a Replicate tensor"] = replicated.placements == (
        Replicate(),
    ) and torch.allclose(replicated.full_tensor(), expected, rtol=1e-6, atol=1e-6)
    column_sharded = distribute_tensor(base.clone(), mesh, [Shard(1)])
    column_sharded.index_add_(
        0, distribute_tensor(index, mesh, [Replicate()]), distribute_tensor(source, mesh, [Shard(1)])
    )
    results["index_add_ on a column-sharded tensor"] = column_sharded.placements == (
        Shard(1),
    ) and torch.allclose(column_sharded.full_tensor(), expected, rtol=1e-6, atol=1e-6)

    partial_piece = DTensor.from_local(base / 2, mesh, [Partial()], run_check=False)
    row_mask = distribute_tensor(
        torch.tensor([[True], [False], [True], [False], [False], [True]]), mesh, [Replicate()]
    )
    expected = base.masked_fill(row_mask.full_tensor(), 0)
    filled = partial_piece.masked_fill(row_mask, 0)
    results["masked_fill with 0 of a Partial tensor stays Partial"] = filled.placements == (
        Partial(),
    ) and torch.allclose(filled.full_tensor(), expected, rtol=1e-6, atol=1e-6)
    partial_piece.masked_fill_(row_mask, 0)
    results["masked_fill_ with 0 of a Partial tensor"] = torch.allclose(
        partial_piece.full_tensor(), expected, rtol=1e-6, atol=1e-6
    )
    # after the zero fills above: a fill value DTensor's strategy cache cannot tell apart
    other = DTensor.from_local(base / 2, mesh, [Partial()], run_check=False).masked_fill(row_mask, 1.5)
    results["masked_fill with 1.5 of a Partial tensor is reduced first"] = torch.allclose(
        other.full_tensor(), base.masked_fill(row_mask.full_tensor(), 1.5), rtol=1e-6, atol=1e-6
    )
    return results


def test_mask_indexing_and_index_add_match_plain_tensors():
    for rank, results in enumerate(run_on_ranks(index_cases_on_rank, world_size=2)):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, (rank, failed)
