"""Full-size ``transformers`` Llama models on the meta device: shapes without memory.

The planner's estimates and published-number checks need real sizes (8B, 70B) but never
their values; on the meta device building one takes milliseconds and no memory.
``transformers`` is a test dependency, imported when a model is built.

Example::

    model = meta_llama(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64)
    assert next(model.parameters()).is_meta
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["meta_llama"]


# LlamaConfig fields the planner's checks share unless a call overrides them.
_DEFAULTS = dict(num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, use_cache=False)


def meta_llama(
    hidden_size: int, num_hidden_layers: int, num_attention_heads: int, **overrides: Any
) -> nn.Module:
    """A ``LlamaForCausalLM`` of these sizes on the meta device; ``overrides`` set other config fields
    (``intermediate_size`` is 4x hidden unless given; see ``_DEFAULTS`` for the rest).

    Example::

        model = meta_llama(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, vocab_size=32000)
    """
    import transformers

    fields = {"intermediate_size": 4 * hidden_size, **_DEFAULTS, **overrides}
    config = transformers.LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        **fields,
    )
    with torch.device("meta"):
        model: nn.Module = transformers.LlamaForCausalLM(config)
    return model
