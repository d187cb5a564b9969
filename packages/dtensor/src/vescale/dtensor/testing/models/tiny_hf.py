"""Tiny ``transformers`` decoder-only models (built from a config, nothing downloaded).

``transformers`` is a test dependency: this module imports it, ``vescale.dtensor`` never
does. Every model is float32 and uses PyTorch's scaled-dot-product attention, so its aten
ops are the ones a real run would send to DTensor.

GPT-2's dropout is set to 0 here, and only here: these models serve the components' tests,
which cut the batch by hand (a dp rank's rows, an accumulation reference's micro-batches), where
no component can know which rows of the global batch it holds, so that no mask could be one
device's. Dropout drawn as one device draws it is tested with the architectures' defaults where
the rows are known: ``test_dmodule_dropout`` (tensor parallelism alone), ``test_dpipe_dropout``,
and ``test_vescale_api_dropout`` through ``vescale.parallelize`` on every axis (dp, tp, pp with
1F1B and ZBV, pp x dp x tp, recomputation), besides ``test_vescale_api_checkpoint``'s resumed run.

Example::

    model = build_tiny_hf_model("llama")
    input_ids, labels = tiny_batch(model.config.vocab_size)
    model(input_ids=input_ids, labels=labels).loss.backward()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "MEMORY_LLAMA_VOCAB",
    "TINY_HF_MODELS",
    "build_tiny_hf_model",
    "memory_llama_config",
    "tiny_batch",
    "tiny_hf_config",
]

TINY_HF_MODELS = ("llama", "mistral", "gpt2", "mixtral")

# Equal query and key/value head counts would hide grouped-query attention; 8 and 4 keep it
# visible while both stay divisible by a tensor-parallel degree of 2 and 4.
_DECODER_SIZES: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    max_position_embeddings=64,
    initializer_range=0.02,
    attn_implementation="sdpa",
)


def tiny_hf_config(name: str, num_key_value_heads: int = 4, **overrides: object) -> Any:
    """A tiny ``transformers`` config for ``name`` in :data:`TINY_HF_MODELS` or any model type.

    ``overrides`` replace config fields (``num_attention_heads=4``, ``pad_token_id=0``).

    Example::

        config = tiny_hf_config("mistral")
        assert config.hidden_size == 32
    """
    config = _tiny_hf_config(name, num_key_value_heads)
    for field_name, value in overrides.items():
        setattr(config, field_name, value)
    return config


def _tiny_hf_config(name: str, num_key_value_heads: int) -> Any:
    import transformers

    if name == "llama":
        return transformers.LlamaConfig(num_key_value_heads=num_key_value_heads, **_DECODER_SIZES)
    if name == "mistral":
        # A window shorter than the test sequence makes the attention take an explicit mask.
        return transformers.MistralConfig(
            num_key_value_heads=num_key_value_heads, sliding_window=4, **_DECODER_SIZES
        )
    if name == "mixtral":
        return transformers.MixtralConfig(
            num_key_value_heads=num_key_value_heads,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            **_DECODER_SIZES,
        )
    if name == "gpt2":
        return transformers.GPT2Config(
            vocab_size=64,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            # Taken by PretrainedConfig's keyword arguments, which GPT2Config's annotations omit.
            attn_implementation="sdpa",  # type: ignore[call-arg]
        )
    if name in transformers.CONFIG_MAPPING:
        # Any other decoder-only architecture, by its model type ("qwen2", "gemma2", ...).
        return transformers.AutoConfig.for_model(
            name, num_key_value_heads=num_key_value_heads, head_dim=4, **_DECODER_SIZES
        )
    raise ValueError(
        f"unknown tiny model {name!r}; choose one of {TINY_HF_MODELS} or a transformers model type"
    )


def build_tiny_hf_model(
    name: str, seed: int = 0, num_key_value_heads: int = 4, **overrides: object
) -> nn.Module:
    """Build the tiny ``transformers`` causal-LM ``name`` with weights drawn from ``seed``.

    ``overrides`` replace config fields (see :func:`tiny_hf_config`).

    Example::

        model = build_tiny_hf_model("gpt2")
        assert model.lm_head.weight.shape == (64, 32)
    """
    import transformers

    config = tiny_hf_config(name, num_key_value_heads, **overrides)
    model_class = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "gpt2": transformers.GPT2LMHeadModel,
    }.get(name)
    torch.manual_seed(seed)
    if model_class is not None:
        model = model_class(config)
    else:
        try:
            # transformers leaves from_config unannotated.
            model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        except ValueError:
            # Architectures without an SDPA path (Gemma-2's logit soft-capping) run eager attention.
            config._attn_implementation = "eager"
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    # Drop-out-free by config, but train() keeps the training code paths (no KV cache reuse).
    model.train()
    built: nn.Module = model
    return built


def tiny_batch(
    vocab_size: int, batch_size: int = 2, seq_len: int = 8, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels (the same ids: causal LMs shift them) drawn from ``seed``.

    Example::

        input_ids, labels = tiny_batch(64)
        assert input_ids.shape == (2, 8)
    """
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    return input_ids, input_ids.clone()


# The Llama whose real training peak the planner's memory estimate is checked against, on one
# rank (planner's tests/test_planner_measured_peak.py) and on a plan's ranks
# (tools/bench/plan_memory.py): tens of MiB of tensors, so that they dominate the resident set.
MEMORY_LLAMA_VOCAB = 4096


def memory_llama_config(
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    sequence_length: int,
) -> Any:
    """The 4-layer ``LlamaConfig`` (vocabulary :data:`MEMORY_LLAMA_VOCAB`, SDPA attention) whose
    training memory the planner's estimate is measured against, at these sizes.

    Example::

        config = memory_llama_config(
            256, 768, num_attention_heads=4, num_key_value_heads=2, sequence_length=256
        )
        assert config.num_hidden_layers == 4
    """
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=4,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=MEMORY_LLAMA_VOCAB,
        max_position_embeddings=sequence_length,
        # Taken by PretrainedConfig's keyword arguments, which LlamaConfig's annotations omit.
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )
