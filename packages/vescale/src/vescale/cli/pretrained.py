"""``--model DIR`` with weights: a ``save_pretrained`` directory's safetensors loaded into each rank's shards.

When the ``--model`` directory holds ``model.safetensors`` (or a sharded checkpoint with its
``model.safetensors.index.json``) beside ``config.json``, the ranks start from those weights:
``vescale.parallelize`` materialises the model's final shards, and before the optimizer is
built (its ZeRO shards and fp32 masters copy the parameters) every rank reads only the byte
ranges of its own shards through dcheckpoint's Hugging Face reader
(:func:`vescale.dcheckpoint.load_hf`); replicated tensors are read once and sent, tied weights
(``lm_head`` = embedding) are filled once through their one parameter.

Example::

    weights = pretrained_weights("my-llama")          # Path("my-llama") or None
    optimizer_fn = with_pretrained_weights(make_adamw, weights)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["pretrained_weights", "with_pretrained_weights"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def pretrained_weights(model: str) -> Path | None:
    """The ``--model`` directory when it holds safetensors weights, else ``None`` (random initialisation).

    Example::

        pretrained_weights("tiny-llama")   # None: a preset
    """
    directory = Path(model)
    if directory.is_dir() and any((directory / name).is_file() for name in _WEIGHT_FILES):
        return directory
    return None


def with_pretrained_weights(
    optimizer_fn: Callable[[nn.Module], Any], weights: Path | None
) -> Callable[[nn.Module], Any]:
    """``optimizer_fn`` that first loads ``weights`` into the materialised parallel module it gets.

    Example::

        vescale.parallelize(plan, model, with_pretrained_weights(make_adamw, Path("my-llama")), ...)
    """
    if weights is None:
        return optimizer_fn

    def load_then_build(module: nn.Module) -> Any:
        from vescale.dcheckpoint import load_hf

        load_hf(module, weights)
        return optimizer_fn(module)

    return load_then_build
