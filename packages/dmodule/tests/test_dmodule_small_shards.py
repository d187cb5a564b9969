"""A parameter dim with fewer rows than the mesh dim has ranks is replicated, not sharded (issue #18).

BERT-style models have a token-type table of 2 rows; the automatic plan makes every embedding
vocab-parallel, and at TP=4 two ranks got an empty shard. DTensor refuses the in-place update
of such a shard, so gradient accumulation (``grad.add_``, two micro-batches) failed with
"in-place operations that require placement changes are not supported" (BERT, ELECTRA, RemBERT
and X-MOD after a checkpoint load into TP=4). Reference: the same module and batches in one
process; compared: every gradient after two accumulated micro-batches (1e-6 relative; float32
summation order measures ~1e-7).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.dmodule.parallelize import parallelize_module
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import assert_close_by_fqn

GRAD_RTOL = 1e-6
PLAN = {"parameter": {r"types\.weight": "S(0)", r"words\.weight": "S(0)"}}


class _Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(16, 8)
        self.types = nn.Embedding(2, 8)

    def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        return (self.words(ids) + self.types(types)).square().mean()


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [
        (torch.randint(0, 16, (2, 5), generator=generator), torch.randint(0, 2, (2, 5), generator=generator))
        for _ in range(2)
    ]


def _accumulated_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    for ids, types in _micro_batches():
        model(ids, types).backward()
    return {
        fqn: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for fqn, p in model.named_parameters()
    }


def _on_rank() -> dict:
    torch.manual_seed(0)
    model = parallelize_module(_Embeddings(), init_mesh(tp=4), PLAN)
    placements = {fqn: p.placements for fqn, p in model.named_parameters()}
    return {"placements": placements, "gradients": _accumulated_gradients(model)}


def test_a_table_with_fewer_rows_than_ranks_is_replicated_and_accumulates_like_one_process():
    torch.manual_seed(0)
    reference = _accumulated_gradients(_Embeddings())
    for result in run_on_ranks(_on_rank, 4, timeout_s=120):
        assert result["placements"] == {"words.weight": (Shard(0),), "types.weight": (Replicate(),)}
        assert_close_by_fqn(result["gradients"], reference, GRAD_RTOL, "accumulated gradient")
