"""Which module list is the blocks under PP=2, and the models that have none to split.

A multimodal model holds several lists of same-class layers: Gemma 3 a SigLIP encoder and a
language model, Phi-4 a 24-layer audio conformer besides its 2 decoder layers. On a text batch
only the language model's layers run, so only lists whose every member ran in the traced
forward are blocks (before: the longest or first list was taken, and the split refused to cut
before a vision layer that "never runs in forward"). A unit that never runs (Fuyu's image
projection) stays on stage 0 (before: ``KeyError``).

Models with no sound split are refused with a typed error that says why: HRM runs its one
block per stack in a recurrent loop; a model whose own parameter is used between its blocks
has no stage for it (Zaya's and XLNet's, used before the blocks or not at all, go to stage 0:
``test_dpipe_pre_block_modules.py``).

Quantities compared, against single-device training of the same tiny model (the
architecture's defaults: tied embeddings, biases) on the whole batch
(``vescale.dtensor.testing.reference``): each of 2 AdamW steps' loss on every rank, and every
parameter's first-step gradient (a parameter the forward never uses has none on either side).
The pipeline accumulates 2 micro-batches where the reference takes the whole batch (float32
summation order). Bounds: 1e-4 on losses and 1e-5 on gradients, as in
``test_dpipe_pre_block_modules.py`` (measured floors there: 1e-7 and 3e-7); a block on the
wrong stage or a skipped language layer errs by O(1).
"""

from __future__ import annotations

import pytest
import torch

from vescale.dpipe import PipelineCutError, PipelinePlan
from vescale.dpipe.architecture_check import (
    architecture_batches,
    assert_pipeline_matches_single_device,
    build_architecture,
)
from vescale.dpipe.split import find_blocks, split_model
from vescale.dpipe.tracing import default_example_batch, trace_model

pytest.importorskip("transformers")

STEPS = 2


def _split(arch: str) -> tuple[torch.nn.Module, tuple[str, ...]]:
    model = build_architecture(arch)
    layout = split_model(model, PipelinePlan(size=2), trace_model(model, default_example_batch(model)))
    return model, layout.boundaries


@pytest.mark.parametrize(
    ("arch", "cut"),
    [
        ("gemma3", "model.language_model.layers.1"),
        ("moss_transcribe_diarize", "model.language_model.layers.1"),
        ("phi4_multimodal", "model.layers.1"),
        ("got_ocr2", "model.language_model.layers.1"),
        ("fuyu", "model.language_model.layers.1"),
    ],
)
def test_blocks_are_the_layers_that_run_and_match_single_device(arch: str, cut: str):
    assert _split(arch)[1] == (cut,)
    # Text only: ids below the image and audio placeholder tokens of the multimodal models.
    from vescale.dtensor.testing.models.hf_architectures import INPUT_ID_LIMIT

    batches = architecture_batches(STEPS, INPUT_ID_LIMIT)
    # The bounds: 1e-4 on losses (the issue's), 1e-5 on gradients (>= 40x the measured floor).
    assert_pipeline_matches_single_device(arch, batches)


def test_find_blocks_without_a_trace_keeps_the_longest_list():
    """Without a trace nothing says which list runs: Phi-4's audio conformer is the longest."""
    model = build_architecture("phi4_multimodal")
    assert find_blocks(model)[0] == "model.embed_tokens_extend.audio_embed.encoder.encoders.0"
    trace = trace_model(model, default_example_batch(model))
    assert find_blocks(model, trace) == ("model.layers.0", "model.layers.1")


def test_default_example_batch_ignores_a_negative_position_limit():
    """XLNet's ``max_position_embeddings`` is -1 (relative positions, no limit)."""
    model = build_architecture("xlnet")
    assert model.config.max_position_embeddings == -1
    assert default_example_batch(model)["input_ids"].shape == (1, 16)


def test_blocks_run_in_a_loop_are_refused():
    """HRM runs its low- and high-level stacks (one layer each) in nested cycles: no stage order."""
    with pytest.raises(PipelineCutError, match=r"runs its block 'model\.L_module\.layers\.0' 6 times"):
        _split("hrm_text")


class _GatedBetweenBlocks(torch.nn.Module):
    """Blocks with a parameter of the model's own multiplied in between them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
        self.gate = torch.nn.Parameter(torch.ones(8))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden) * (self.gate if index == 2 else 1.0)
        return hidden


def test_a_parameter_used_where_the_blocks_run_is_refused_naming_it():
    model = _GatedBetweenBlocks()
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    with pytest.raises(PipelineCutError, match=r"'gate' \(used where the blocks run\)"):
        split_model(model, PipelinePlan(size=2), trace_model(model, batch))


def test_a_cut_inside_a_custom_autograd_function_is_refused():
    """Reformer runs all its layers inside one autograd Function (reversible layers), whose backward
    recomputes them from its own saved outputs: a hidden state swapped in at layer 1 never reaches
    that backward. Before, pp2 trained silently wrong (SGD, second step's loss 3.5e-3 off one
    process); the split now refuses it, at the 8 tokens Reformer trains at."""
    model = build_architecture("reformer")
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    trace = trace_model(model, batch)
    with pytest.raises(PipelineCutError, match=r"inside the forward of the custom autograd function _Rev"):
        split_model(model, PipelinePlan(size=2), trace)
    assert not trace_model(
        build_architecture("llama"), default_example_batch(build_architecture("llama"))
    ).inside_autograd_function
