"""Tensor parallelism with activation checkpointing: each decoder block recomputed in backward.

``torch.utils.checkpoint`` (non-reentrant) around each block, applied after
``parallelize_module`` as ``vescale.parallelize`` applies ``activation_checkpointing="full"``,
recomputes the block's forward during backward, after the DModule's forward (and its
implicit-replication scope) has exited. Llama's blocks take the rotary tables as plain
tensors, so the recomputation mixed them with DTensors ("got mixed torch.Tensor and DTensor")
until the scope also covered submodule forwards.

Quantity compared: the loss and every parameter gradient of one step of tiny Llama under
the automatic plan on tp2, sequence parallelism off and on, against the same model, weights
and batch in one process without recomputation (float32). Recomputation replays the same
ops on the same values, so the errors are those of tensor parallelism alone: the loss within
1e-5 relative and the gradients within 1e-4 (a sharded matmul sums in another order; the
bounds of ``test_dmodule_auto_plan``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
from torch import nn
from torch.utils.checkpoint import checkpoint

from vescale.dmodule.auto_plan import auto_sharding_plan
from vescale.dmodule.parallelize import parallelize_module
from vescale.dmodule.testing.step_errors import assert_step_errors_within, step_errors
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

pytest.importorskip("transformers")

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _checkpoint_each_block(blocks: nn.ModuleList) -> None:
    # The block's forward is replaced on the instance, so its hooks stay outside the checkpoint.
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)


def _recomputed_step_errors(mesh: Any, sequence_parallel: bool) -> dict:
    from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model, tiny_batch

    model = build_tiny_hf_model("llama")
    reference = copy.deepcopy(model)
    input_ids, labels = tiny_batch(model.config.vocab_size)
    parallelize_module(model, mesh, auto_sharding_plan(model, sequence_parallel=sequence_parallel))
    _checkpoint_each_block(model.model.layers)
    attention_calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: attention_calls.append(1))
    errors = step_errors(model, reference, input_ids, labels)
    # Block 0's attention runs once in the forward, then once per recomputation in backward.
    return {"recomputed": len(attention_calls) - 1, **errors}


def recomputed_step_errors(sequence_parallel_settings: tuple[bool, ...]) -> dict[bool, dict]:
    mesh = init_mesh(tp=2)
    return {setting: _recomputed_step_errors(mesh, setting) for setting in sequence_parallel_settings}


def test_recomputed_blocks_under_tensor_parallelism_give_single_device_gradients():
    settings = (False, True)
    for rank, results in enumerate(run_on_ranks(recomputed_step_errors, world_size=2, args=(settings,))):
        for sequence_parallel, result in results.items():
            where = f"rank {rank}, sequence_parallel={sequence_parallel}"
            assert result["recomputed"] == 1, f"{where}: block 0 was not recomputed in backward"
            assert_step_errors_within(result, LOSS_RTOL, GRAD_RTOL, where)
