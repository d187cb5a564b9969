"""Concatenation that tolerates the legacy empty tensor, as ``torch.cat`` does.

``torch.cat`` skips 1-D tensors with zero elements whatever the other inputs' rank; caches
start from one (``transformers``' KV cache does ``torch.cat([torch.tensor([]), keys])``).
PyTorch's DTensor strategy asks every input for the same placement, so it tries to shard
the empty 1-D tensor on the heads dim and fails. Here an empty 1-D input stays Replicate
and the other inputs share one placement: Replicate, a Shard on any dim but the
concatenation dim, or Partial sum.

Example::

    import vescale.dtensor.ops
    keys = torch.cat([torch.tensor([]), heads_sharded_keys], dim=-2)   # under implicit replication
    assert keys.placements == heads_sharded_keys.placements
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from vescale.dtensor._interleaved_ops import restore_interleaved_ops

__all__ = ["cat_strategy"]

aten = torch.ops.aten


def _is_legacy_empty(spec: Any) -> bool:
    return len(spec.shape) == 1 and spec.shape[0] == 0


@register_sharding(aten.cat.default)  # type: ignore[untyped-decorator]  # torch leaves it unannotated
def cat_strategy(tensors: list[Any], dim: int = 0) -> list[tuple[list[Placement], list[Placement]]]:
    """Placements of ``torch.cat(tensors, dim)``; legacy empty inputs stay Replicate.

    Example::

        joined = torch.cat([shard1_a, shard1_b], dim=2)
        assert joined.placements == (Shard(1),)
    """
    ranked = [spec for spec in tensors if not _is_legacy_empty(spec)]
    if not ranked:
        return [([Replicate()], [Replicate()] * len(tensors))]
    ndim = len(ranked[0].shape)
    cat_dim = dim % ndim
    candidates: list[Placement] = [Replicate(), Partial("sum")]
    candidates += [Shard(tensor_dim) for tensor_dim in range(ndim) if tensor_dim != cat_dim]
    strategies = []
    for placement in candidates:
        inputs = [Replicate() if _is_legacy_empty(spec) else placement for spec in tensors]
        strategies.append(([placement], inputs))
    return strategies


# register_sharding replaced cat's strategy, InterleavedShard's part-wise join with it if an
# InterleavedShard was used before vescale.dtensor.ops was imported.
restore_interleaved_ops()
