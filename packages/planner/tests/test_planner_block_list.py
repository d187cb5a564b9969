"""The planner profiles the block list that runs: a multimodal model's language-model layers.

Gemma 3 and Phi-4 multimodal hold a vision or audio encoder list of the same class members
as well; a text batch never runs it. Before, the planner took the longest list (Phi-4's 24
conformer layers; Gemma 3's vision layers, first of two equal ones) and measured its
per-block activations from blocks that never ran, and a cost-chosen pipeline split named
members of that list.
"""

from __future__ import annotations

import pytest

from vescale.planner.profile import find_repeated_blocks, profile_model

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("arch", "blocks"),
    [("gemma3", "model.language_model.layers"), ("phi4_multimodal", "model.layers")],
)
def test_the_profiled_blocks_are_the_layers_that_run(arch: str, blocks: str):
    from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm

    model = build_tiny_causal_lm(arch, seed=0)
    assert find_repeated_blocks(model)[0] != blocks, "one block list only: the test tests nothing"
    profile = profile_model(model, sequence_length=16)
    assert profile.blocks_fqn == blocks
    assert profile.num_blocks == len(model.get_submodule(blocks))
    assert profile.block_input_bytes > 0
