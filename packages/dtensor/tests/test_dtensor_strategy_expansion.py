"""Strategies expanded over the non-batch mesh dims only choose what the full expansion chooses.

``vescale.dtensor._compat.install_batch_dims_expansion`` skips the candidates that the batch-dims
guard would discard (see its module). The workload below, a tensor-parallel MLP block with a
vocabulary-parallel head and loss over (dp, tp) and (pp, dp, tp) meshes, plus an input sharded
over dp (which must take torch's full path), runs forward and backward twice on each rank: with the
reduced expansion, then with torch's (``batch_dims_expansion_disabled``). Compared: every
propagation's decision (the op, its output placements, the input placements it redistributes to),
and every output and gradient, bitwise. The test also checks that the reduced path ran at all and
that it skipped the dp-sharded op, so that it cannot pass vacuously.
"""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor.testing import run_on_ranks


def _workload(mesh_dims: dict[str, int]) -> tuple[list[torch.Tensor], int]:
    """Forward and backward of the block; the full outputs and gradients, and the count of ops."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from vescale.dtensor.mesh import init_mesh

    mesh = init_mesh(**mesh_dims)
    batch_dims = [Replicate()] * (mesh.ndim - 1)
    generator = torch.Generator().manual_seed(0)

    def parameter(shape: tuple[int, ...], placement) -> torch.Tensor:
        value = torch.randn(*shape, generator=generator)
        return distribute_tensor(value, mesh, [*batch_dims, placement]).requires_grad_()

    embedding = parameter((32, 16), Shard(1))  # sharded over the hidden dim
    up, down = parameter((24, 16), Shard(0)), parameter((16, 24), Shard(1))
    norm, head = parameter((16,), Replicate()), parameter((32, 16), Shard(0))
    tokens = distribute_tensor(
        torch.randint(0, 32, (2, 6), generator=generator), mesh, [Replicate()] * mesh.ndim
    )
    hidden = F.embedding(tokens, embedding).redistribute(mesh, [Replicate()] * mesh.ndim)
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    block = F.linear(F.silu(F.linear(normed, up)) * F.linear(normed, up), down) + hidden
    logits = F.linear(block, head)  # sharded over the vocabulary
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    # An input sharded over dp: no batch dim is Replicate in it, so torch's full expansion runs.
    over_dp = [Shard(0) if name == "dp" else Replicate() for name in mesh.mesh_dim_names]
    sharded = distribute_tensor(torch.randn(4, 16, generator=generator), mesh, over_dp)
    loss = loss + (sharded * norm).sum() / 100
    loss.backward()
    values = [loss, logits, block] + [p.grad for p in (embedding, up, down, norm, head)]
    return [value.full_tensor() for value in values]


def both_expansions(mesh_dims: dict[str, int]) -> dict[str, object]:
    """On every rank: the workload's decisions and values, reduced then full, and the reduced count."""
    import vescale.dtensor.ops  # noqa: F401 - installs the guard and the reduced expansion
    from vescale.dtensor import _compat
    from vescale.dtensor._compat import strategy_expansion

    propagator = _compat.dtensor_sharding_propagator()
    propagate = propagator.propagate_op_sharding_non_cached
    decisions: list[tuple] = []
    reduced_ops: list[str] = []
    reduced_expansion = strategy_expansion._reduced_expansion

    def recording(op_schema):
        sharding = propagate(op_schema)
        redistribute = sharding.redistribute_schema
        wanted = (
            tuple(spec.placements for spec in redistribute.args_spec) if redistribute is not None else None
        )
        outputs = sharding.output_spec
        placements = (
            tuple(None if spec is None else spec.placements for spec in outputs)
            if isinstance(outputs, (tuple, list))
            else (None if outputs is None else outputs.placements)
        )
        decisions.append((str(op_schema.op), placements, wanted, sharding.needs_redistribute))
        return sharding

    def counting(types, expand, mesh, op_schema, strategies, keywords):
        result = reduced_expansion(types, expand, mesh, op_schema, strategies, keywords)
        if result is not None:
            reduced_ops.append(str(op_schema.op))
        return result

    cache_class = type(propagator.propagate_op_sharding)
    propagator.propagate_op_sharding_non_cached = recording
    propagator.propagate_op_sharding = cache_class(recording)
    strategy_expansion._reduced_expansion = counting
    try:
        _compat.clear_dtensor_sharding_caches()
        reduced_values = _workload(mesh_dims)
        reduced_decisions, decisions[:] = list(decisions), []
        counted = list(reduced_ops)
        with _compat.batch_dims_expansion_disabled():
            full_values = _workload(mesh_dims)
        full_decisions = list(decisions)
    finally:
        strategy_expansion._reduced_expansion = reduced_expansion
        propagator.propagate_op_sharding_non_cached = propagate
        propagator.propagate_op_sharding = cache_class(propagate)
        _compat.clear_dtensor_sharding_caches()
    return {
        "reduced": (reduced_decisions, reduced_values),
        "full": (full_decisions, full_values),
        "reduced_ops": counted,
        "after_full": len(reduced_ops) - len(counted),
    }


@pytest.mark.parametrize(
    "mesh_dims", [{"dp": 2, "tp": 2}, {"pp": 1, "dp": 2, "tp": 2}], ids=["dp2xtp2", "pp1xdp2xtp2"]
)
def test_reduced_expansion_makes_the_full_expansion_s_every_decision(mesh_dims: dict[str, int]):
    for rank, result in enumerate(run_on_ranks(both_expansions, 4, args=(mesh_dims,), timeout_s=240)):
        (reduced_decisions, reduced_values), (full_decisions, full_values) = result["reduced"], result["full"]
        assert reduced_decisions == full_decisions, rank
        for reduced, full in zip(reduced_values, full_values, strict=True):
            assert torch.equal(reduced, full), rank
        # Not vacuous: most ops took the reduced path, and none did inside batch_dims_expansion_disabled.
        assert len(result["reduced_ops"]) >= 20 and "aten.mm.default" in result["reduced_ops"], result[
            "reduced_ops"
        ]
        assert result["after_full"] == 0
        # The dp-sharded multiply is among the decisions compared (its output is sharded over dp).
        dp = list(mesh_dims).index("dp")
        assert any(
            op == "aten.mul.Tensor" and placements[dp].is_shard() for op, placements, _, _ in full_decisions
        )
    print(
        f"{mesh_dims}: {len(full_decisions)} decisions equal, {len(result['reduced_ops'])} expansions reduced"
    )
