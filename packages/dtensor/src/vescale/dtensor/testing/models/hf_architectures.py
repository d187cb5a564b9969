"""Every causal-LM architecture of the installed ``transformers``, at a tiny configuration
derived from that architecture's own defaults.

A tiny configuration starts from the architecture's default config and shrinks only sizes:
hidden 64, 8 query heads of 8 dims, key/value heads at the default grouped-query ratio (a
4:1 default gives 8 query and 2 key/value heads), intermediate 128, vocabulary 128, 4
experts with top-2 routing, and as few layers as cover every distinct per-layer type of the
default (sliding and full attention, dense and MoE MLPs; at least 2). Tied embeddings,
norms, biases, activations and rope types stay as the architecture has them, and so do its
dropout probabilities (GPT-2 drops 10% in four places; a parallel run must draw one device's
masks); the variant ``"gpt2[dropout=0]"`` sets every dropout, router jitter and layer drop to 0.
Attention is PyTorch's SDPA where the architecture supports it, else eager. Nothing is
downloaded.

Example::

    model = build_tiny_causal_lm("gemma")            # tied embeddings, as Gemma ships
    input_ids, labels = tiny_causal_lm_batch()
    model(input_ids=input_ids, labels=labels).loss.backward()
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "ARCH_OVERRIDES",
    "INPUT_ID_LIMIT",
    "TINY_SIZES",
    "DefaultConfigError",
    "build_tiny_causal_lm",
    "causal_lm_architectures",
    "causal_lm_loss",
    "default_model_failure",
    "one_process_failure",
    "split_variant",
    "tiny_causal_lm_batch",
    "tiny_causal_lm_config",
]

logger = logging.getLogger("vescale.dtensor")

TINY_SIZES = {"hidden": 64, "heads": 8, "head_dim": 8, "intermediate": 128, "vocab": 128, "experts": 4}
# Input ids stay below the ids that special tokens are moved to (see _token_ids), so that a
# random batch never contains an image/audio placeholder token of a multimodal config.
INPUT_ID_LIMIT = 96
_MAX_LAYERS = 8
# What a variant ("gpt2[dropout=0]") may set: a size, the key/value heads, dropout off.
_VARIANT_KEYS = {*TINY_SIZES, "kv_heads", "dropout"}

_HIDDEN = {
    "hidden_size",
    "n_embd",
    "d_model",
    "dim_model",
    "out_hidden_size",
    "projector_output_dim",
    "adapter_in_dim",
    "adapter_out_dim",
    "adapter_input_size",
}
_INTERMEDIATE = {
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "d_ff",
    "dff",
    "dim_ff",
    "decoder_ffn_dim",
    "encoder_ffn_dim",
    "ffn_hidden_size",
    "mlp_dim",
    "intermediate_size_mlp",
    "dense_intermediate_size",
    "d_inner",
}
_EXPERT_INTERMEDIATE = {
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "shared_experts_intermediate_size",
    "expert_ffn_hidden_size",
}
# Ordered: the first present names the layer count (max_window_layers is only capped by it).
_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "max_window_layers",
)
# Ordered: the first present is the query-head count that key/value heads are a ratio of.
_QUERY_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "decoder_attention_heads",
    "encoder_attention_heads",
    "attention_heads",
    "swa_num_attention_heads",
    "linear_num_heads",
)
_HEAD_DIM = {
    "head_dim",
    "dim_head",
    "kv_channels",
    "attention_head_dim",
    "swa_head_dim",
    "d_kv",
    "linear_head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "index_head_dim",
    "qk_rope_head_dim",
    "d_head",
}
_POSITIONS = {
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_seq_len",
    "model_max_length",
    "original_max_position_embeddings",
}
_WINDOWS = {
    "sliding_window",
    "sliding_window_size",
    "local_attention_window_len",
    "window_size",
    "attention_chunk_size",
}
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "num_experts_per_token"}
_ONE_AT_MOST = {
    "n_group",
    "topk_group",
    "num_expert_group",
    "n_shared_experts",
    "num_shared_experts",
    "moe_num_shared_experts",
    "first_k_dense_replace",
    "num_dense_layers",
    "moe_layer_start_index",
    "num_kv_shared_layers",
    "attn_layer_offset",
    "expert_layer_offset",
}
_SMALL_RANKS = {
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "o_lora_rank": 16,
    "index_n_heads": 4,
    "index_topk": 4,
    "laurel_rank": 8,
    "hc_lowrank": 8,
    "hidden_size_per_layer_input": 16,
    "ple_embed_dim": 16,
    "mamba_d_state": 16,
    "state_size": 16,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "mamba_n_heads": 8,
    "vocab_size_per_layer_input": 128,
    "decoder_vocab_size": 128,
    "unpadded_vocab_size": 128,
    "zero_expert_num": 2,
    "attn_layer_period": 2,
    "expert_layer_period": 2,
    "sliding_window_pattern": 2,
    "_sliding_window_pattern": 2,
    "global_attn_every_n_layers": 2,
    "no_rope_layer_interval": 2,
    "layer_group_size": 2,
    "n_layers_per_attn_res_block": 1,
    "num_layers_per_stack": 1,
    "o_groups": 2,
}
# Index lists over layers: remapped onto the kept layers.
# Where the generic shrinking alone cannot build the architecture: its own extra needs.
ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    # one transformer block shared by every hybrid layer: tying needs at least two of them
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    # axial position embeddings tile the sequence (2 x 4 = 8) and split the hidden size (16 + 48)
    "reformer": {
        "axial_pos_shape": [2, 4],
        "axial_pos_embds_dim": [16, 48],
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_buckets": 2,
        "is_decoder": True,
    },
}
_LAYER_INDEX_LISTS = {"moe_layers", "full_attn_idxs", "mlp_only_layers", "hybrid_layer_ids"}


def causal_lm_architectures() -> list[str]:
    """The model types of ``transformers``' causal-LM auto mapping, sorted.

    Example::

        assert "llama" in causal_lm_architectures()
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _kept_layers(config: dict[str, Any], layer_count: int) -> list[int]:
    """The fewest layers (at least 2) whose per-layer settings cover every distinct one."""
    per_layer = [value for value in config.values() if isinstance(value, list) and len(value) == layer_count]
    index_lists = [set(config[name]) for name in _LAYER_INDEX_LISTS if isinstance(config.get(name), list)]
    kept: dict[tuple[Any, ...], int] = {}
    for layer in range(layer_count):
        signature = tuple(str(values[layer]) for values in per_layer) + tuple(layer in s for s in index_lists)
        kept.setdefault(signature, layer)
    layers = sorted(kept.values())[:_MAX_LAYERS]
    for layer in range(layer_count):
        if len(layers) >= 2:
            break
        if layer not in layers:
            layers = sorted([*layers, layer])
    return layers


def _shrink(config: dict[str, Any], sizes: dict[str, int]) -> dict[str, Any]:
    """The config dict with sizes shrunk (recursing into sub-configs); other fields kept."""
    shrunk: dict[str, Any] = {}
    query_heads = next((config[name] for name in _QUERY_HEADS if isinstance(config.get(name), int)), None)
    layer_count = next((config[name] for name in _LAYERS if isinstance(config.get(name), int)), None)
    layers = _kept_layers(config, layer_count) if layer_count else []
    for name, value in config.items():
        shrunk[name] = _shrink_field(name, value, config, sizes, query_heads, layer_count, layers)
    return shrunk


def _kv_heads(value: int, query_heads: int | None, sizes: dict[str, int]) -> int:
    if not query_heads or value <= 0:
        return value
    if "kv_heads" in sizes:
        return sizes["kv_heads"]
    ratio = max(1, query_heads // value)
    return max(1, sizes["heads"] // ratio)


def _shrink_field(
    name: str,
    value: Any,
    config: dict[str, Any],
    sizes: dict[str, int],
    query_heads: int | None,
    layer_count: int | None,
    layers: list[int],
) -> Any:
    if isinstance(value, dict) and "model_type" in value:
        return _shrink(value, sizes)
    if (
        isinstance(value, list)
        and layer_count
        and len(value) == layer_count
        and name not in _LAYER_INDEX_LISTS
    ):
        kept = [value[layer] for layer in layers]
        if name.endswith("_per_layer"):  # per-layer sizes (head counts): shrunk as the size itself
            field = name.removesuffix("_per_layer")
            return [_shrink_field(field, item, config, sizes, query_heads, None, layers) for item in kept]
        return kept
    if isinstance(value, list) and name in _LAYER_INDEX_LISTS:
        return [position for position, layer in enumerate(layers) if layer in value]
    if value is None and name in _TOP_K and any(config.get(experts) for experts in _EXPERTS):
        return 2  # an MoE whose default leaves top-k unset routes each token to 2 experts here
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float):
        switched_off = sizes.get("dropout", 1) == 0
        return 0.0 if switched_off and _is_dropout(name) else value
    return _shrink_int(name, value, config, sizes, query_heads, len(layers))


def _is_dropout(name: str) -> bool:
    return "dropout" in name or "pdrop" in name or name in ("router_jitter_noise", "layerdrop")


def _shrink_int(
    name: str, value: int, config: dict[str, Any], sizes: dict[str, int], query_heads: int | None, layers: int
) -> int:
    if name in _HIDDEN or (name in ("embed_dim", "dim") and "hidden_size" not in config):
        return sizes["hidden"]
    if name in _INTERMEDIATE:
        return sizes["intermediate"] if value > 0 else value
    if name in _EXPERT_INTERMEDIATE:
        return sizes["intermediate"] // 2 if value > 0 else value
    if name in _LAYERS:
        return layers if name != "max_window_layers" else min(value, layers)
    if name in _QUERY_HEADS:
        return sizes["heads"]
    if name in ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "swa_num_key_value_heads"):
        reference = config.get("swa_num_attention_heads") if name.startswith("swa") else query_heads
        return _kv_heads(value, reference, sizes)
    if name in ("linear_num_key_heads", "linear_num_value_heads"):
        value_heads = config.get("linear_num_value_heads") or value
        return max(1, sizes["heads"] * value // value_heads)
    state_heads = config.get("num_heads") or config.get("mamba_n_heads") or config.get("n_mamba_heads")
    expand: int | None = config.get("expand") or config.get("mamba_expand")
    if (
        name in ("head_dim", "mamba_d_head", "mamba_headdim")
        and expand
        and state_heads
        and "mamba" in str(config)
    ):
        # state-space heads tile the expanded hidden size: heads * head_dim == expand * hidden
        heads: int = (
            _SMALL_RANKS["mamba_n_heads"]
            if name != "head_dim" or "num_heads" not in config
            else sizes["heads"]
        )
        return expand * sizes["hidden"] // heads
    if name == "mamba_d_ssm" and expand:
        return expand * sizes["hidden"]
    if name == "head_dim" and value > 0 and "qk_rope_head_dim" not in config:
        # heads * head_dim != hidden where the default has it so (Seed-OSS, Gemma): the same ratio
        default_head_dim = _default_head_dim(config)
        scaled = round(sizes["head_dim"] * value / default_head_dim / 2) * 2 if default_head_dim else 0
        return min(4 * sizes["head_dim"], max(4, scaled)) if scaled else sizes["head_dim"]
    if name in _HEAD_DIM:
        return sizes["head_dim"]
    if name == "qk_head_dim":
        return 2 * sizes["head_dim"]  # qk_nope_head_dim + qk_rope_head_dim
    if name == "rotary_dim":
        # the same fraction of each head as the default rotates
        default_head_dim = config.get("head_dim") or _default_head_dim(config)
        return max(2, 2 * (value * sizes["head_dim"] // default_head_dim // 2)) if default_head_dim else value
    if name == "vocab_size":
        return sizes["vocab"]
    if name in _POSITIONS:
        return 64
    if name in _WINDOWS:
        return min(value, 4) if value > 0 else value
    if name in _EXPERTS:
        return sizes["experts"] if value > 0 else value
    if name in _TOP_K:
        return min(value, 2)
    if name in _ONE_AT_MOST:
        return min(value, 1)
    if name == "moe_layer_end_index":
        return layers - 1
    if name in ("mamba_d_head",) and config.get("mamba_expand"):
        mamba_expand: int = config["mamba_expand"]
        return mamba_expand * sizes["hidden"] // _SMALL_RANKS["mamba_n_heads"]
    if name in _SMALL_RANKS:
        return min(value, _SMALL_RANKS[name]) if value > 0 else value
    if name.endswith(("_token_id", "_token_index")) and value >= INPUT_ID_LIMIT:
        return value  # moved into the vocabulary by _token_ids
    full_hidden: int | None = config.get("hidden_size")
    if name in ("attention_hidden_size",) and full_hidden:
        return value * sizes["hidden"] // full_hidden
    if name == "embedding_size" and full_hidden:
        return max(8, value * sizes["hidden"] // full_hidden)
    return value


def _default_head_dim(config: dict[str, Any]) -> int | None:
    hidden = next((config[name] for name in _HIDDEN if isinstance(config.get(name), int)), None)
    heads = next((config[name] for name in _QUERY_HEADS if isinstance(config.get(name), int)), None)
    return hidden // heads if hidden and heads else None


def _token_ids(config: dict[str, Any], vocab: int) -> None:
    """Move special token ids beyond the tiny vocabulary to distinct ids at its top."""
    free = iter(range(vocab - 1, INPUT_ID_LIMIT - 1, -1))
    assigned: dict[int, int] = {}
    for name, value in config.items():
        if isinstance(value, dict) and "model_type" in value:
            _token_ids(value, vocab)
        elif name.endswith(("_token_id", "_token_index", "_token_ids")):
            if isinstance(value, int) and not isinstance(value, bool) and value >= INPUT_ID_LIMIT:
                config[name] = assigned.setdefault(value, next(free))
            elif isinstance(value, list):
                config[name] = [
                    assigned.setdefault(v, next(free)) if v >= INPUT_ID_LIMIT else v for v in value
                ]


def _changed(shrunk: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    changed = {}
    for name, value in shrunk.items():
        if isinstance(value, dict) and "model_type" in value:
            sub_changes = _changed(value, default[name])
            if sub_changes:
                changed[name] = sub_changes
        elif value != default.get(name):
            changed[name] = value
    return changed


class DefaultConfigError(ValueError):
    """The architecture's default config or model fails in ``transformers`` itself."""


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def default_model_failure(model_type: str) -> str | None:
    """Why the architecture's full-size default model fails to build (on the meta device), or None."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type]())  # type: ignore[no-untyped-call]
    except Exception as error:
        return _first_line(error)
    return None


def split_variant(arch: str) -> tuple[str, dict[str, int]]:
    """``"seed_oss[kv_heads=4]"`` -> ``("seed_oss", {"kv_heads": 4})``: a model type and its overrides.

    The overrides are sizes of :data:`TINY_SIZES`, ``kv_heads``, and ``dropout=0`` (every dropout 0).

    Example::

        assert split_variant("llama") == ("llama", {})
    """
    model_type, _, variant = arch.partition("[")
    sizes = {}
    for item in filter(None, variant.rstrip("]").split(",")):
        key, _, value = item.partition("=")
        if key.strip() not in _VARIANT_KEYS:
            raise ValueError(f"unknown size {key.strip()!r} in {arch!r}; choose from {sorted(_VARIANT_KEYS)}")
        sizes[key.strip()] = int(value)
    return model_type, sizes


def tiny_causal_lm_config(model_type: str, sizes: dict[str, int] | None = None) -> Any:
    """The tiny config of ``model_type``, derived from its default config (module docstring).

    ``model_type`` may name a variant, ``"seed_oss[kv_heads=4]"``: sizes that replace
    :data:`TINY_SIZES` (``kv_heads`` replaces the key/value heads of the default ratio).

    Example::

        config = tiny_causal_lm_config("llama")
        assert (config.num_attention_heads, config.hidden_size) == (8, 64)
    """
    from transformers import CONFIG_MAPPING

    model_type, variant_sizes = split_variant(model_type)
    sizes = {**TINY_SIZES, **variant_sizes, **(sizes or {})}
    config_class = CONFIG_MAPPING[model_type]
    try:
        default = config_class().to_dict()
    except Exception as error:
        raise DefaultConfigError(
            f"{model_type}'s default config does not build: {_first_line(error)}"
        ) from error
    shrunk = _shrink(default, sizes)
    _token_ids(shrunk, sizes["vocab"])
    if "use_cache" in shrunk:
        shrunk["use_cache"] = False  # the training setting
    # Only the changed fields go back to the constructor, so that it derives the rest (head_dim,
    # per-layer rope parameters, ...) from them as it derives the defaults.
    config = config_class(**{**_changed(shrunk, default), **ARCH_OVERRIDES.get(model_type, {})})
    if hasattr(config, "is_decoder") and not config.is_encoder_decoder:
        config.is_decoder = True  # encoder-style stacks (BERT family) as causal LMs
    return config


def build_tiny_causal_lm(
    model_type: str, seed: int | None = 0, sizes: dict[str, int] | None = None
) -> nn.Module:
    """The tiny causal LM of ``model_type`` with weights drawn from ``seed``, in train mode.

    ``seed=None`` draws from the current generator state (e.g. under ``vescale.deferred_init``
    after ``vescale.manual_seed``).

    Example::

        model = build_tiny_causal_lm("qwen3")
        assert model.config.num_key_value_heads == 2    # Qwen3's default 4:1 GQA kept
    """
    from transformers import AutoModelForCausalLM

    config = tiny_causal_lm_config(model_type, sizes)
    errors = []
    for attention in ("sdpa", "eager"):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            # transformers leaves from_config unannotated.
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)  # type: ignore[no-untyped-call]
        except (ValueError, ImportError, NotImplementedError) as error:
            errors.append(error)
            continue
        if getattr(config, "languages", None) and hasattr(model, "set_default_language"):
            model.set_default_language(config.languages[0])  # X-MOD's adapters need a language
        model.train()
        built: nn.Module = model
        return built
    raise errors[-1]


def tiny_causal_lm_batch(
    batch_size: int = 2, seq_len: int = 8, seed: int = 1, steps: int = 1
) -> tuple[torch.Tensor, torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and labels (the same ids; causal LMs shift them) below :data:`INPUT_ID_LIMIT`.

    With ``steps > 1``, a list of that many batches.

    Example::

        input_ids, labels = tiny_causal_lm_batch()
        assert input_ids.shape == (2, 8)
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        input_ids = torch.randint(0, INPUT_ID_LIMIT, (batch_size, seq_len), generator=generator)
        batches.append((input_ids, input_ids.clone()))
    return batches[0] if steps == 1 else batches


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own next-token loss on a batch.

    Example::

        loss = causal_lm_loss(model, *tiny_causal_lm_batch())
    """
    loss: torch.Tensor = model(input_ids=input_ids, labels=labels).loss
    return loss


def one_process_failure(
    model_type: str, builder: Callable[[str], nn.Module] = build_tiny_causal_lm
) -> str | None:
    """Why ``model_type`` does not train one step in one process at its tiny config, or None.

    Example::

        assert one_process_failure("llama") is None
    """
    try:
        model = builder(model_type)
        loss = causal_lm_loss(model, *tiny_causal_lm_batch())
        if loss is None:
            return "the model returns no loss for labels"
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        if not torch.isfinite(loss):
            return f"the loss is not finite ({loss.item()})"
    except Exception as error:  # any failure means: not runnable, with its first line as the reason
        reason = _first_line(error)
        if not isinstance(error, DefaultConfigError) and default_model_failure(split_variant(model_type)[0]):
            reason = f"its default config fails in transformers too: {reason}"
        return reason[:200]
    return None
