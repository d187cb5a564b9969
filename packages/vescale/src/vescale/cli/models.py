"""``--model``: a preset name, a ``transformers`` config JSON, or ``module:Class``, as a model builder.

The builder makes a fresh model in whatever device context it is called under: the planner calls it
under ``torch.device("meta")``, training under ``vescale.deferred_init``, the single-device
reference on the CPU. The presets are ``transformers`` configs, so nothing is downloaded.

Example::

    source = resolve_model("llama-3-70b")
    with torch.device("meta"):
        model = source.build()
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vescale.cli.errors import CLIUsageError

__all__ = ["PRESETS", "ModelPreset", "ModelSource", "resolve_model"]


@dataclass(frozen=True)
class ModelPreset:
    """A named ``transformers`` config: its ``model_type``, the fields set, and one line about it."""

    model_type: str
    fields: dict[str, Any]
    description: str


PRESETS: dict[str, ModelPreset] = {
    "tiny-llama": ModelPreset(
        "llama",
        dict(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
        "byte-level Llama, 4 layers, hidden 128 (~0.9M parameters); the train default",
    ),
    "llama-7b": ModelPreset(
        "llama",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            max_position_embeddings=4096,
        ),
        "Llama-2-7B shape",
    ),
    "llama-3-70b": ModelPreset(
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
        "Llama-3-70B shape",
    ),
    "gpt2": ModelPreset("gpt2", {}, "GPT-2 small (124M parameters)"),
    "mixtral-tiny": ModelPreset(
        "mixtral",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=256,
            # The batched experts run on meta tensors; the default grouped_mm needs bf16 there.
            experts_implementation="batched_mm",
        ),
        "byte-level Mixtral, 2 layers, 4 experts (top-2)",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """What ``--model`` named: a display name, a zero-argument builder, and its ``transformers`` config."""

    name: str
    build: Callable[[], Any]
    config: Any = None

    @property
    def vocab_size(self) -> int | None:
        """The config's vocabulary size, or ``None`` when the model has no ``transformers`` config."""
        return getattr(self.config, "vocab_size", None)


def _config_builder(config: Any) -> Callable[[], Any]:
    import transformers

    def build() -> Any:
        # transformers leaves from_config unannotated.
        return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]

    return build


def _preset_source(name: str) -> ModelSource:
    import transformers

    preset = PRESETS[name]
    config = transformers.AutoConfig.for_model(preset.model_type, **preset.fields)
    return ModelSource(name, _config_builder(config), config)


def _config_file_source(spec: str) -> ModelSource:
    path = Path(spec)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise CLIUsageError(
            f"--model {spec!r}: no such file{' (no config.json in that directory)' if path.is_dir() else ''}"
            "; "
            f"pass a transformers config.json, a preset ({', '.join(PRESETS)}) or module:Class"
        )
    try:
        fields = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CLIUsageError(f"--model {spec!r} is not a JSON config: {error}; fix the file") from None
    model_type = fields.pop("model_type", None) if isinstance(fields, dict) else None
    if not isinstance(model_type, str):
        raise CLIUsageError(
            f'--model {spec!r} has no "model_type" (e.g. "llama"); add it, as save_pretrained writes it'
        )
    import transformers

    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as error:
        raise CLIUsageError(f"--model {spec!r}: transformers refuses the config: {error}") from None
    # A save_pretrained directory is named after the model; any other JSON file by its own name.
    name = config_path.parent.name if config_path.name == "config.json" else config_path.stem
    return ModelSource(name or "model", _config_builder(config), config)


def _import_source(spec: str) -> ModelSource:
    module_name, _, attribute = spec.partition(":")
    # A console script does not put the working directory on sys.path; `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise CLIUsageError(
            f"--model {spec!r}: cannot import {module_name!r} ({error}); check the name"
        ) from None
    target = getattr(module, attribute, None)
    if target is None:
        raise CLIUsageError(f"--model {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    import transformers

    if isinstance(target, transformers.PretrainedConfig):
        return ModelSource(attribute, _config_builder(target), target)
    if not callable(target):
        raise CLIUsageError(
            f"--model {spec!r} is a {type(target).__name__}; name an nn.Module class, a function "
            "returning a module, or a transformers config"
        )
    return ModelSource(attribute, target, None)


def resolve_model(spec: str) -> ModelSource:
    """The model ``spec`` names: a preset, a config JSON file (or its directory), or ``module:Class``.

    Example::

        source = resolve_model("tiny-llama")
        model = vescale.deferred_init(source.build)
    """
    if spec in PRESETS:
        return _preset_source(spec)
    if spec.endswith(".json") or os.sep in spec or Path(spec).exists():
        return _config_file_source(spec)
    if ":" in spec:
        return _import_source(spec)
    close = difflib.get_close_matches(spec, PRESETS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise CLIUsageError(
        f"--model {spec!r} is not a preset, a config file or module:Class; {hint}"
        f"the presets are {', '.join(PRESETS)}"
    )
