"""Modules that run before the blocks and are not embeddings (an embedding LayerNorm) under PP=2.

BLOOM's ``word_embeddings_layernorm`` and BERT's ``embeddings.LayerNorm`` run once before the
first block and only feed the hidden stream, so they stay on stage 0 with the embeddings;
:mod:`vescale.dpipe.stage_inputs` follows the data on fake tensors to make sure. A module whose
output reaches a later stage's blocks by another way (CPM-Ant's ``position_bias``) travels to
that stage after the hidden state (an integer tensor too, where PyTorch's shape inference runs
on zeros); a value that cannot (one a unit computes but does not return) is refused with a
typed error naming the unit, instead of the later stage computing with a stale value. A frozen
parameter that only a later stage holds (AFMoE's ``expert_bias``) is left out of the
``DistributedOptimizer`` as data parallelism leaves it out. Model code that reads an earlier
stage's parameter (Llama 4: ``embed_tokens.weight.device``) finds a stand-in, not ``None``.

Quantities compared, against single-device training of the same tiny model (the architecture's
defaults: tied embeddings, biases) on the whole batch (``vescale.dtensor.testing.reference``):
each of 4 AdamW steps' loss on every rank, and every parameter's first-step gradient. The
pipeline accumulates 2 micro-batches where the reference takes the whole batch (float32
summation order). Measured worst errors: loss 9.9e-8 (BLOOM), 9.8e-8 (BERT); first-step
gradient 2.3e-7 (BLOOM), 2.1e-7 (BERT). Bounds: the issue's 1e-4 on losses and 1e-5 (>= 40x
the floor) on gradients; a stale LayerNorm on stage 1 errs by O(1).
"""

from __future__ import annotations

import pytest

from vescale.dpipe import PipelineCutError, PipelinePlan
from vescale.dpipe.architecture_check import (
    architecture_batches,
    assert_pipeline_matches_single_device,
    build_architecture,
)
from vescale.dpipe.split import split_model
from vescale.dpipe.stage_inputs import find_stage_inputs
from vescale.dpipe.tracing import default_example_batch, trace_model

pytest.importorskip("transformers")

STEPS = 4


def _assert_pipeline_matches_single_device(
    arch: str, zero_stage: int | None = None, tensor_parallel: bool = False
) -> None:
    batches = architecture_batches(STEPS, build_architecture(arch).config.vocab_size)
    assert_pipeline_matches_single_device(arch, batches, zero_stage, tensor_parallel)


@pytest.mark.parametrize("arch", ["bloom", "bert"])
def test_embedding_layernorm_stays_on_stage_zero_and_matches_single_device(arch: str):
    _assert_pipeline_matches_single_device(arch)


def test_frozen_parameter_in_a_later_stage_is_left_to_the_optimizer():
    """AFMoE's routers hold ``expert_bias``, an ``nn.Parameter`` with ``requires_grad=False``, in
    the stage-1 MoE layers only: data parallelism leaves it out and the optimizer never steps it
    (it gets no gradient), on one device as under the pipeline. Measured: loss 9.9e-8, first-step
    gradient 2.1e-7 relative."""
    _assert_pipeline_matches_single_device("afmoe", zero_stage=1)


def test_model_code_reading_another_stages_parameter_runs():
    """Llama 4's forward moves the token ids to ``embed_tokens.weight.device`` on every stage;
    stage 1 holds a one-element stand-in of that weight (its device, dtype and shape), not
    ``None``. Measured: loss 9.8e-8, first-step gradient 2.3e-7 relative."""
    _assert_pipeline_matches_single_device("llama4_text")


@pytest.mark.parametrize("arch", ["cpmant", "zamba", "roformer", "hy_v4"])
def test_values_a_later_stage_needs_travel_with_the_hidden_state(arch: str):
    """A unit's output that stage 1 needs besides the hidden state is sent after it, and stage 1's
    skipped unit returns it: CPM-Ant's position bias, Zamba's embeddings (its shared block reads
    them at every layer), RoFormer's sinusoidal positions (frozen: no gradient travels back) and
    HunYuan V4's attention top-k indices, an integer tensor its later layers reuse (refused while
    PyTorch's shape inference ran on uninitialised memory, where an index is out of range).
    Before, each was refused ("stage 1 uses the output of ..."). XLM (its residual stream is a local
    variable of the model's loop: stage 0's last LayerNorm travels) and Gemma 4 (per-layer inputs)
    pass the sweep; their float32 losses drift from single-device training by more than this
    test's bound through rounding alone. Measured: loss 4.5e-7 (CPM-Ant), 9.8e-8 (Zamba), 9.7e-8
    (RoFormer), 9.9e-8 (HunYuan V4); first-step gradient 3.3e-7 (CPM-Ant), 2.6e-7 (Zamba,
    RoFormer), 2.9e-7 (HunYuan V4)."""
    model = build_architecture(arch)
    batch = default_example_batch(model)
    layout = split_model(model, PipelinePlan(size=2), trace_model(model, batch))
    assert find_stage_inputs(model, layout, batch).received_by(1), "nothing to carry: the test tests nothing"
    _assert_pipeline_matches_single_device(arch)


@pytest.mark.parametrize("arch", ["zamba2", "roformer"])
def test_carried_values_of_a_tensor_parallel_stage_match_single_device(arch: str):
    """pp2 x tp2 with SGD: a carried value may be a DTensor (Zamba 2's vocab-parallel embeddings
    are a masked partial sum, reduced once on stage 0 for the model and the next stage alike).
    Before, the data-following pass saw only the operators on local tensors, found nothing to
    carry, and stage 1 read a stale value without an error: Zamba 2's loss was 5.3e-5 off at the
    first step and 4.9e-4 at the second (2.2e-3 by the fourth), RoFormer's 1.5e-6. Measured now:
    loss 9.9e-8 (Zamba 2), 9.5e-8 (RoFormer); first-step gradient 7.3e-7, 7.0e-7."""
    _assert_pipeline_matches_single_device(arch, tensor_parallel=True)


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        # Gemma 3n's last layers reuse keys and values that earlier layers put in a dict.
        ("gemma3n_text", r"value that 'model.layers.1' .* computes on an earlier stage but does not return"),
    ],
)
def test_values_that_cannot_travel_are_refused_before_any_computation(arch: str, message: str):
    model = build_architecture(arch)
    batch = default_example_batch(model)
    layout = split_model(model, PipelinePlan(size=2), trace_model(model, batch))
    with pytest.raises(PipelineCutError, match=message):
        find_stage_inputs(model, layout, batch)


@pytest.mark.parametrize("arch", ["blenderbot", "bamba"])
def test_skipped_units_return_what_the_unit_returns(arch: str):
    """On stage 1, stage 0's units are skipped and must return what they return when run:
    BlenderBot's learned positions are an ``nn.Embedding`` called with the input's shape (not
    token ids), so their own forward gives the shape; Bamba's decoder layers return
    ``(hidden_states, attention_weights)``, which its model unpacks. Before, stage 1 raised
    ("'tuple' object has no attribute 'shape'", "not enough values to unpack") and stage 0 hung."""
    _assert_pipeline_matches_single_device(arch)


@pytest.mark.parametrize("arch", ["jamba", "olmo_hybrid"])
def test_hybrid_layer_lists_are_split_like_repeated_blocks(arch: str):
    """Jamba's and OLMo-Hybrid's layers are of two classes (recurrent and attention) in one
    ``ModuleList``: with no list of two or more same-class blocks, that list is the blocks
    (before: "has no nn.ModuleList of repeated blocks"). Measured: loss 9.8e-8 (both), first-step
    gradient 2.9e-7 (Jamba), 2.3e-7 (OLMo-Hybrid)."""
    _assert_pipeline_matches_single_device(arch)


def _carried_of_tensor_parallel_model(arch: str) -> list[list[str]]:
    import vescale.dmodule
    from vescale.dtensor import init_mesh

    model = build_architecture(arch)
    mesh = init_mesh(tp=2)
    vescale.dmodule.parallelize_module(model, mesh, vescale.dmodule.auto_sharding_plan(model), mesh_dim="tp")
    batch = default_example_batch(model)
    layout = split_model(model, PipelinePlan(size=2), trace_model(model, batch))
    inputs = find_stage_inputs(model, layout, batch)
    return [[output.unit for output in inputs.received_by(stage)] for stage in range(layout.num_stages)]


@pytest.mark.parametrize(("arch", "carried"), [("llama", [[], []]), ("zamba2", [[], ["model.embed_tokens"]])])
def test_a_tensor_parallel_hidden_state_is_not_carried(arch: str, carried: list[list[str]]):
    """On a DTensor model the received hidden state is a new DTensor whose local tensor empty_like
    made from the marked one: its marks must go too. Before, every stage 'needed' the previous
    block's output (the hidden state itself), and a stage that skipped a unit carried only to a
    later stage raised KeyError (pp2 x tp2 with interleaved stages, GPT-2 and Llama in CI)."""
    from vescale.dtensor.testing import run_on_ranks

    for result in run_on_ranks(_carried_of_tensor_parallel_model, world_size=2, args=(arch,)):
        assert result == carried


@pytest.mark.parametrize(
    "arch",
    [
        "zaya",
        "xlnet[dropout=0]",
        # XLNet's activations are sequence-first ([length, batch, hidden]): a micro-batch's dropout
        # replay reads its rows where the pipeline's trace at two batch sizes found them (1.2e-2 off
        # at step 1 when read as batch-major), and its later stage's glue draws the dropout of the
        # relative position embedding its layers read as the first stage does.
        "xlnet",
    ],
)
def test_parameters_of_the_module_around_the_blocks_go_to_the_stage_that_uses_them(arch: str):
    """Zaya's model shifts and scales the embeddings by parameters of its own before the first
    block; XLNet's holds ``mask_emb``, unused by a causal-LM forward. Each belongs to stage 0
    (stage 1 holds a stand-in). Before, both were refused ("has parameters of its own ... belongs
    to no stage"). Measured: loss 9.9e-8 (Zaya), 6.5e-8 (XLNet); first-step gradient 7.3e-7
    (Zaya), 3.4e-7 (XLNet), both without dropout."""
    model = build_architecture(arch)
    batch = default_example_batch(model)
    layout = split_model(model, PipelinePlan(size=2), trace_model(model, batch))
    assert layout.loose_parameters and set(layout.loose_parameters.values()) == {0}, layout.loose_parameters
    _assert_pipeline_matches_single_device(arch)
