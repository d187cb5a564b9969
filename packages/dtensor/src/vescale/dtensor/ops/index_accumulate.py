"""Sharding strategies of ``index_add``: accumulation into rows picked by an index.

Without one, DTensor propagates ``index_add_`` through its decomposition, which may answer
``Partial`` for the output of a ``Replicate`` tensor updated in place by a ``Partial`` source;
an in-place op cannot change its tensor's data to match, so DTensor relabelled the tensor
``Partial`` while every rank held the whole base: LongCat-Flash's experts
(``final.index_add_(0, token_idx, partial_expert_output)``) came out 1.2e-3 off, silently.

The strategies here keep the tensor's own placement: all Replicate (a Partial source is
reduced first); sharded on a dimension other than the indexed one, with the source sharded
the same way; or Partial with a Partial source (the sum of the ranks' bases plus the sum of
their sources is the single-device result).

Example::

    import vescale.dtensor.ops
    final = torch.zeros_like(hidden)               # Replicate
    final.index_add_(0, token_idx, expert_output)  # expert_output Partial: all-reduced first
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["index_add_strategies"]

aten = torch.ops.aten


def index_add_strategies(
    self: Any, dim: int, index: Any, source: Any, alpha: Any = 1
) -> list[tuple[list[Placement], list[Placement | None]]]:
    """Output and input placements for ``index_add(self, dim, index, source)``.

    Example::

        strategies = index_add_strategies(self_meta, 0, index_meta, source_meta)
        assert strategies[0] == ([Replicate()], [Replicate(), None, Replicate(), Replicate()])
    """
    ndim = len(self.shape)
    indexed = dim % ndim if ndim else 0
    strategies: list[tuple[list[Placement], list[Placement | None]]] = [
        ([Replicate()], [Replicate(), None, Replicate(), Replicate()]),
        ([Partial()], [Partial(), None, Replicate(), Partial()]),
    ]
    for shard_dim in range(ndim):
        if shard_dim != indexed:
            strategies.append(([Shard(shard_dim)], [Shard(shard_dim), None, Replicate(), Shard(shard_dim)]))
    return strategies


register_sharding(aten.index_add.default)(index_add_strategies)
register_sharding(aten.index_add_.default)(index_add_strategies)
