"""Tensor parallelism beyond the key/value-head count: key/value heads are replicated.

Llama with 8 query heads and 2 key/value heads (its grouped-query ratio of 4) on TP=4 and TP=8
holds fewer key/value heads than ranks. The automatic plan marks each attention projection with
its heads (``plan.heads``); resolving it for such a size replicates the key and value
projections over ``tp`` and keeps the query and output projections sharded by heads, and
attention pairs each rank's query heads with their key/value head. A size that would split a
query head is refused while resolving, before any parameter changes, naming the module.

Quantity compared: the loss and every parameter gradient of one step, every rank on the whole
batch, against the same model, weights and batch in one process (float32): the loss within 1e-5
relative, every gradient within 1e-4 (the bounds of ``test_dmodule_auto_plan``; a sharded matmul
sums in another order, measured at ~6e-7 here). A key/value gradient that missed the other
ranks' query heads would be off by O(1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from vescale.dmodule.auto_plan import auto_sharding_plan, plan_tensor_parallel
from vescale.dmodule.errors import ShardingPlanError
from vescale.dmodule.parallelize import parallelize_module
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import gradient_errors, relative_error

pytest.importorskip("transformers")

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _llama(num_attention_heads: int = 8, num_key_value_heads: int = 2):
    from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model

    return build_tiny_hf_model(
        "llama", num_key_value_heads=num_key_value_heads, num_attention_heads=num_attention_heads, head_dim=4
    )


def kv_replicated_step_errors(tp: int, sequence_parallel: bool) -> dict:
    from vescale.dtensor.testing.models.tiny_hf import tiny_batch

    model = _llama()
    reference = copy.deepcopy(model)
    input_ids, labels = tiny_batch(model.config.vocab_size)
    parallelize_module(
        model, init_mesh(tp=tp), auto_sharding_plan(model, sequence_parallel=sequence_parallel)
    )
    attention = model.model.layers[0].self_attn
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    reference_loss = reference(input_ids=input_ids, labels=labels).loss
    reference_loss.backward()
    return {
        "placements": {
            name: getattr(attention, name).weight.placements
            for name in ("q_proj", "k_proj", "v_proj", "o_proj")
        },
        "loss_error": relative_error(loss, reference_loss),
        "grad_errors": gradient_errors(model, reference),
    }


@pytest.mark.parametrize(("tp", "sequence_parallel"), [(4, False), (4, True), (8, False)])
def test_llama_with_two_key_value_heads_beyond_tp_matches_single_device(tp, sequence_parallel):
    for rank, result in enumerate(
        run_on_ranks(kv_replicated_step_errors, world_size=tp, args=(tp, sequence_parallel))
    ):
        assert result["placements"] == {
            "q_proj": (Shard(0),),
            "k_proj": (Replicate(),),
            "v_proj": (Replicate(),),
            "o_proj": (Shard(1),),
        }, rank
        assert result["loss_error"] <= LOSS_RTOL, rank
        worst = max(result["grad_errors"], key=result["grad_errors"].get)
        assert result["grad_errors"][worst] <= GRAD_RTOL, (rank, worst, result["grad_errors"][worst])


def test_plan_records_the_heads_of_each_attention_projection():
    with torch.device("meta"):
        model = _llama()
    result = plan_tensor_parallel(model)
    heads = result.plan.to_dict()["heads"]
    assert heads[r"model\.layers\.\d+\.self_attn\.q_proj\.weight"] == [8, 8]
    assert heads[r"model\.layers\.\d+\.self_attn\.k_proj\.weight"] == [2, 8]
    assert heads[r"model\.layers\.\d+\.self_attn\.v_proj\.weight"] == [2, 8]
    assert result.head_counts == (8,)
    result.check_tp_size(8)


def test_a_size_that_splits_query_heads_is_refused_before_anything_is_applied():
    with torch.device("meta"):
        model = _llama(num_attention_heads=6, num_key_value_heads=2)
    plan = auto_sharding_plan(model)
    message = (
        r"module 'model\.layers\.0\.self_attn\.(q|k|v)_proj': its attention has 6 query heads, which a "
        r"tensor-parallel size of 4 \(mesh dim 0\) would split; the largest size up to 4 that keeps heads "
        r"whole is 3"
    )
    with pytest.raises(ShardingPlanError, match=message):
        plan.resolve(model, mesh_shape=(4,), mesh_dim=0)
    resolved = plan.resolve(model, mesh_shape=(3,), mesh_dim=0)
    assert resolved.parameters["model.layers.0.self_attn.k_proj.weight"].placements == (Replicate(),)


def test_heads_section_round_trips_and_bad_entries_name_the_pattern():
    from vescale.dmodule.sharding_plan import ShardingPlan

    plan = ShardingPlan.from_dict({"parameter": {r"k\.weight": "S(0)"}, "heads": {r"k\.weight": [2, 8]}})
    assert ShardingPlan.from_json(plan.to_json()) == plan
    with pytest.raises(
        ShardingPlanError, match=r"= \[2\]: give \[heads, query_heads\], two positive integers"
    ):
        ShardingPlan.from_dict({"heads": {r"k\.weight": [2]}})
