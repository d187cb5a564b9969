"""The planner's meta-tensor trace survives model code that reads values (issue #18).

``transformers``' Llama with ``use_cache=False`` asks whether the positions are packed sequences
(``(position_ids[:, -1] == 0).all()``) during its forward; the planner answers such reads as an
ordinary training batch would (:class:`vescale.dtensor.deferred.fake_values.FakeValuePolicy`).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from vescale.dtensor.deferred.fake_values import FakeValuePolicy
from vescale.planner import ParallelChoices, estimate_memory, generate_plan

_SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64
)


def _meta(config) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_a_llama_without_kv_cache_is_planned_like_one_with_it():
    configs = [
        transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, use_cache=use_cache, **_SIZES)
        for use_cache in (False, True)
    ]
    without_cache, with_cache = (_meta(config) for config in configs)
    plan = generate_plan(without_cache, {"sequence_length": 16, "memory_per_device_gb": 1.0}, world_size=2)
    assert plan.world_size == 2
    choices = ParallelChoices(sequence_length=16)
    assert estimate_memory(without_cache, choices) == estimate_memory(with_cache, choices)


@pytest.mark.parametrize(
    "config",
    [
        transformers.GPT2Config(
            vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, use_cache=False
        ),
        transformers.GemmaConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False, **_SIZES
        ),
    ],
    ids=["gpt2", "gemma"],
)
def test_tied_embedding_models_without_kv_cache_are_planned_with_tensor_parallelism(config):
    assert config.tie_word_embeddings
    model = _meta(config)
    plan = generate_plan(
        model, {"sequence_length": 16, "tensor_parallel.size": 2, "memory_per_device_gb": 1.0}, world_size=2
    )
    assert plan.mesh_size("tp") == 2 and plan.memory_estimate.total > 0


def test_value_reads_on_meta_tensors_answer_as_an_ordinary_batch():
    positions = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with FakeValuePolicy():
        assert bool((positions == 0).all()) is True
        assert bool((positions < 0).any()) is False
        assert positions.sum().item() == 0
        assert torch.nonzero(positions).shape == (1, 2)


def test_boolean_mask_selection_on_meta_and_fake_tensors_finds_one_hit():
    hidden = torch.zeros(2, 8, 4, device="meta")
    mask = torch.zeros(2, 8, dtype=torch.bool, device="meta")
    with FakeValuePolicy() as values:
        selected = hidden[mask]
        assert selected.shape == (1, 4)
        hidden[mask] = selected
        assert torch.masked_select(hidden, hidden > 0).shape == (1,)
    assert values.guessed_shapes == 2  # the index and masked_select; an assignment keeps its shape


def test_a_deferred_xmod_selecting_tokens_per_language_by_mask_is_planned():
    # X-MOD's language adapters select each language's tokens with hidden_states[lang_ids == i]:
    # on a deferred (fake) model that index has no shape until the policy answers it.
    from vescale.dmodule import deferred_init
    from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm

    model = deferred_init(build_tiny_causal_lm, "xmod", None)
    constraints = {"data_parallel.size": 2, "tensor_parallel.size": 2, "global_batch_size": 4}
    plan = generate_plan(model, constraints, world_size=4)
    assert plan.mesh_size("tp") == 2 and plan.memory_estimate.total > 0
    sharded = plan.to_dict()["tensor_parallel"]["sharding_plan"]["parameter"]
    assert any("adapter_modules" in pattern for pattern in sharded), "the traced adapters are sharded"


def test_a_model_whose_longest_sequence_is_max_seq_len_is_profiled_within_it():
    # MPT names its longest sequence max_seq_len; its ALiBi table has that many positions, so a
    # profile at the planner's default 2048 tokens stopped on a broadcast of 64 against 2048.
    from vescale.dmodule import deferred_init
    from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm

    model = deferred_init(build_tiny_causal_lm, "mpt", None)
    plan = generate_plan(model, {"tensor_parallel.size": 2, "global_batch_size": 4}, world_size=2)
    assert plan.to_dict()["reasons"]["sequence_length"] == "the model's longest sequence (64 positions)"
    assert model.config.max_seq_len == 64


def test_a_deferred_jetmoe_splitting_tokens_by_read_counts_is_planned():
    # JetMoE splits its tokens by per-expert counts read with .tolist(): every count reads 0 on
    # tensors without data, and the split into [0, 0, 0, 0] did not add up to the routed tokens;
    # FakeValuePolicy now splits them evenly over the experts.
    from vescale.dmodule import deferred_init
    from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm

    model = deferred_init(build_tiny_causal_lm, "jetmoe", None)
    plan = generate_plan(model, {"tensor_parallel.size": 2, "global_batch_size": 4}, world_size=2)
    assert plan.mesh_size("tp") == 2 and plan.memory_estimate.total > 0


class _SplitsUnevenly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.inner(torch.nn.functional.one_hot(input_ids, 8).float())
        return torch.cat(hidden.split([1, 1], dim=-1), dim=-1)  # sizes that do not add up to 8


class _Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _SplitsUnevenly()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.body(input_ids)


def test_a_failing_op_in_the_trace_is_a_typed_error_naming_its_module():
    # No value was read, so the policy does not re-split: the model's own bug stays an error.
    from vescale.dmodule import ShardingPlanError

    with torch.device("meta"):
        model = _Wrapper()
    with pytest.raises(ShardingPlanError, match=r"module 'body' .* split_with_sizes"):
        generate_plan(model, {"tensor_parallel.size": 2, "global_batch_size": 4}, world_size=2)
