"""Grouped-query attention on a mesh with more dims than ``tp``: heads stay sharded over ``tp``.

With fewer key/value heads than query heads, head sharding is valid when the key/value
heads divide into the head chunks. DTensor's attention strategy once bounded the chunks by
the size of the whole mesh, so Llama with 2 key/value heads on dp2 x tp2 (and the default
4 on pp2 x dp2 x tp2) gathered its heads instead, and the gathered output's layout disagreed
with the DTensor's strides: ``attn_output.reshape(*input_shape, -1)`` then failed with "view
size is not compatible with input tensor's size and stride".

Quantity compared: the loss and every parameter gradient of one step of tiny Llama (4 query
heads, 2 key/value heads) under the automatic plan on dp2 x tp2, sequence parallelism off and
on, every rank on the whole batch, against the same model, weights and batch in one process
(float32): the loss within 1e-5 relative and the gradients within 1e-4, because a sharded
matmul sums in another order (the bounds of ``test_dmodule_auto_plan``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from torch.distributed.tensor import Shard

from vescale.dmodule.auto_plan import auto_sharding_plan
from vescale.dmodule.parallelize import parallelize_module
from vescale.dmodule.testing.step_errors import assert_step_errors_within, step_errors
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

pytest.importorskip("transformers")

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _grouped_query_step_errors(mesh: Any, sequence_parallel: bool) -> dict:
    from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model, tiny_batch

    model = build_tiny_hf_model("llama", num_key_value_heads=2, num_attention_heads=4)
    reference = copy.deepcopy(model)
    input_ids, labels = tiny_batch(model.config.vocab_size)
    parallelize_module(model, mesh, auto_sharding_plan(model, sequence_parallel=sequence_parallel))
    attention_outputs = []
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda module, args: attention_outputs.append(args[0].placements)
    )
    errors = step_errors(model, reference, input_ids, labels)
    return {"heads_sharded_on_tp": attention_outputs[0][1] == Shard(2), **errors}


def grouped_query_step_errors(sequence_parallel_settings: tuple[bool, ...]) -> dict[bool, dict]:
    mesh = init_mesh(dp=2, tp=2)
    return {setting: _grouped_query_step_errors(mesh, setting) for setting in sequence_parallel_settings}


def test_llama_with_two_key_value_heads_on_dp2_tp2_matches_single_device():
    settings = (False, True)
    for rank, results in enumerate(run_on_ranks(grouped_query_step_errors, world_size=4, args=(settings,))):
        for sequence_parallel, result in results.items():
            where = f"rank {rank}, sequence_parallel={sequence_parallel}"
            # o_proj reads the attention output (batch, seq, heads * head_dim) sharded by heads.
            assert result["heads_sharded_on_tp"], f"{where}: the attention output was gathered"
            assert_step_errors_within(result, LOSS_RTOL, GRAD_RTOL, where)
