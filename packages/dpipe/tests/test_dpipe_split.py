"""Splitting unmodified ``transformers`` models into stages, and the errors for bad cuts.

Single-process: splitting only traces the model on fake tensors. The expected cuts are
worked out by hand in each test from the tiny models' sizes.
"""

from __future__ import annotations

import pytest
import torch

from vescale.dpipe import PipelineCutError, PipelinePlan, PipelinePlanError, SplitPointError, StageCountError
from vescale.dpipe.split import find_blocks, split_model
from vescale.dpipe.tracing import default_example_batch, trace_model
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model


def _llama(**overrides):
    return build_tiny_hf_model("llama", **{"num_hidden_layers": 6, **overrides})


def _split(model, **plan_fields):
    plan = PipelinePlan(**{"schedule": "gpipe", **plan_fields})
    return split_model(model, plan, trace_model(model, default_example_batch(model)))


def test_blocks_are_the_longest_module_list_of_one_class():
    assert find_blocks(_llama()) == tuple(f"model.layers.{index}" for index in range(6))
    gpt2 = build_tiny_hf_model("gpt2", n_layer=3)
    assert find_blocks(gpt2) == ("transformer.h.0", "transformer.h.1", "transformer.h.2")


def test_trace_records_execution_order_not_registration_order():
    model = _llama()
    trace = trace_model(model, default_example_batch(model))
    # Llama registers rotary_emb after norm but runs it before the blocks.
    assert trace.call_index["model.rotary_emb"] < trace.call_index["model.layers.0"]
    assert trace.call_index["model.layers.5"] < trace.call_index["model.norm"] < trace.call_index["lm_head"]
    # One block of batch 1 x 16 tokens: q, o (32x32), k, v (32x16) and three MLP matmuls
    # (32x64), 2 FLOPs per multiply-add. FlopCounterMode has no formula for the CPU
    # scaled-dot-product attention kernel, so attention itself counts 0 on CPU.
    linear = 16 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64)
    assert trace.forward_flops["model.layers.0"] == 2 * linear


def test_uniform_split_gives_earlier_stages_the_remainder():
    model = _llama()
    layout = _split(model, size=4)
    assert layout.boundaries == ("model.layers.2", "model.layers.4", "model.layers.5")
    assert layout.units_of(0) == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert layout.units_of(3) == ["model.layers.5", "model.norm", "lm_head"]


def test_params_and_flops_balance_differently_when_the_head_is_heavy():
    # vocab 1024: embedding and head hold 32768 parameters each (3.5 blocks of 9280), so
    # balancing parameters keeps the cut in the middle; the embedding costs no FLOPs but the
    # head costs 2*16*32*1024 = 1048576 (3.6 blocks of 294912), so balancing FLOPs moves
    # blocks to stage 0: 5 blocks (1474560) against 1 block + head (1343488).
    model = _llama(vocab_size=1024)
    assert _split(model, size=2, split_method="uniform").boundaries == ("model.layers.3",)
    assert _split(model, size=2, split_method="params").boundaries == ("model.layers.3",)
    assert _split(model, size=2, split_method="flops").boundaries == ("model.layers.5",)


def test_gpt2_tied_embedding_belongs_to_first_and_last_stage():
    model = build_tiny_hf_model("gpt2", n_layer=4, tie_word_embeddings=True)
    layout = _split(model, size=2)
    assert layout.unit_stage["transformer.wte"] == 0 and layout.unit_stage["lm_head"] == 1
    assert model.lm_head.weight is model.transformer.wte.weight


def test_float32_mixtral_splits_through_its_grouped_matmul_experts():
    # transformers runs the experts through torch._grouped_mm, whose fake kernel takes bf16 only;
    # the trace answers it by shape (vescale.dtensor.grouped_mm_shapes), so a float32 MoE splits.
    model = build_tiny_hf_model("mixtral", num_hidden_layers=4)
    assert next(model.parameters()).dtype == torch.float32
    layout = _split(model, size=2)
    assert layout.boundaries == ("model.layers.2",)
    assert layout.units_of(1)[-2:] == ["model.norm", "lm_head"]


def test_manual_split_after_the_blocks():
    layout = _split(_llama(), size=3, split_method="manual", split_points=("model.layers.3", "lm_head"))
    assert layout.units_of(2) == ["lm_head"]


def test_split_point_naming_no_module_lists_closest():
    with pytest.raises(
        SplitPointError, match=r"'model\.layer\.3' names no module.*closest: \['model\.layers\.3'"
    ):
        _split(_llama(), size=2, split_method="manual", split_points=("model.layer.3",))


def test_more_stages_than_blocks():
    with pytest.raises(StageCountError, match=r"asks for 8 stages but LlamaForCausalLM has only 6 blocks"):
        _split(_llama(), size=4, virtual_stages=2, schedule="interleaved_1f1b")


def test_cut_inside_a_block_says_where_and_why():
    with pytest.raises(
        PipelineCutError, match=r"'model\.layers\.2\.mlp': it runs inside 'model\.layers\.2'.*residual"
    ):
        _split(_llama(), size=2, split_method="manual", split_points=("model.layers.2.mlp",))


def test_cut_before_a_module_whose_input_is_not_the_hidden_state():
    model = build_tiny_hf_model("gpt2", n_layer=2)
    with pytest.raises(
        PipelineCutError, match=r"cannot cut before 'transformer\.wpe': only the hidden state"
    ):
        _split(model, size=2, split_method="manual", split_points=("transformer.wpe",))


def test_cut_before_a_container_that_never_runs():
    with pytest.raises(PipelineCutError, match=r"'model\.layers': it never runs.*'model\.layers\.0'"):
        _split(_llama(), size=2, split_method="manual", split_points=("model.layers",))


def test_repeated_split_points_are_refused():
    with pytest.raises(PipelinePlanError, match=r"must be distinct and in execution order"):
        _split(_llama(), size=3, split_method="manual", split_points=("model.layers.2", "model.layers.2"))


class _BlocksOnly(torch.nn.Module):
    """Blocks and nothing else: cutting before the first block leaves stage 0 empty."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def test_stage_without_parameters_is_refused():
    model = _BlocksOnly()
    plan = PipelinePlan(size=2, schedule="gpipe", split_method="manual", split_points=("layers.0",))
    with pytest.raises(StageCountError, match=r"stage 0 would own no parameters"):
        split_model(model, plan, trace_model(model, {"hidden": torch.zeros(1, 4)}))


def test_split_leaves_the_model_usable():
    model = _llama()
    _split(model, size=2)
    input_ids = torch.zeros(1, 4, dtype=torch.long)
    assert model(input_ids=input_ids, labels=input_ids).loss.isfinite()


class _DataDependentModel(torch.nn.Module):
    """A forward whose shapes depend on tensor values, which fake tensors do not hold."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.read = read

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.read == "unique":
            # An output shape no training batch fixes: nothing to answer it with.
            return self.embed(torch.unique(input_ids))
        # XLM asserts on lengths.max().item(); MoE routing finds tokens with nonzero.
        length = int(input_ids.max().item()) + 1
        tokens = input_ids[:, :length][torch.nonzero(input_ids[:, :length] >= 0, as_tuple=True)]
        return self.embed(tokens)


def test_values_read_in_forward_are_answered_as_a_training_batch_would():
    trace = trace_model(_DataDependentModel("item"), {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert "embed" in trace.call_index


def test_model_that_cannot_run_on_fake_tensors_is_reported():
    model = _DataDependentModel("unique")
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    expected = r"could not run _DataDependentModel's forward on fake tensors"
    with pytest.raises(PipelineCutError, match=expected):
        trace_model(model, batch)
