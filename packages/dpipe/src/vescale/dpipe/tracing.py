"""One forward pass of the model on fake tensors: which modules run, in which order, at what cost.

Splitting needs the execution order of modules (the registration order can differ: Llama
registers ``rotary_emb`` after ``norm`` but runs it first), the FLOPs of each module and the
output structure of each block. The pass runs on fake tensors, so it allocates no
activations, and under ``no_grad``, so it leaves no gradients.

Example::

    trace = trace_model(model, {"input_ids": torch.zeros(1, 16, dtype=torch.long)})
    assert trace.call_index["model.layers.0"] < trace.call_index["model.norm"]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vescale.dpipe import _compat
from vescale.dpipe.errors import PipelineCutError
from vescale.dtensor.deferred.fake_values import FakeValuePolicy
from vescale.dtensor.grouped_mm_shapes import GroupedMatmulShapes

__all__ = ["ModelTrace", "default_example_batch", "trace_model"]


@dataclass(frozen=True)
class ModelTrace:
    """What one forward pass showed: call order, inclusive FLOPs and output kind per module FQN."""

    call_index: dict[str, int]
    # FLOPs of each module's first call, its submodules included.
    forward_flops: dict[str, int]
    # FLOPs counted before each module's first call began (to cost what runs between modules).
    flops_before: dict[str, int]
    total_flops: int
    # What each module returned: None for a tensor, else the length of its tuple (Bamba's layers
    # return (hidden_states, attention_weights)); a skipped unit returns the same shape.
    output_lengths: dict[str, int | None]
    # The class of the model's output (e.g. CausalLMOutputWithPast), rebuilt by the pipeline.
    output_type: type


def default_example_batch(
    model: nn.Module, batch_size: int = 1, seq_len: int = 16
) -> dict[str, torch.Tensor]:
    """A batch of zero token ids, the input of a causal LM, sized to fit the model's positions.

    Example::

        batch = default_example_batch(model)
        assert batch["input_ids"].shape == (1, 16)
    """
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", seq_len)
    return {"input_ids": torch.zeros(batch_size, min(seq_len, max_positions), dtype=torch.long)}


def trace_model(model: nn.Module, example_batch: Mapping[str, Any]) -> ModelTrace:
    """Run ``model(**example_batch)`` once on fake tensors and record what ran.

    Example::

        trace = trace_model(model, default_example_batch(model))
        assert "lm_head" in trace.call_index
    """
    call_index: dict[str, int] = {}
    forward_flops: dict[str, int] = {}
    flops_before: dict[str, int] = {}
    output_lengths: dict[str, int | None] = {}
    flop_counter = FlopCounterMode(display=False)

    def before(fqn: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if fqn not in call_index:
                call_index[fqn] = len(call_index)
                flops_before[fqn] = flop_counter.get_total_flops()

        return hook

    def after(fqn: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if fqn not in forward_flops:
                forward_flops[fqn] = flop_counter.get_total_flops() - flops_before[fqn]
                output_lengths[fqn] = len(output) if isinstance(output, tuple) else None

        return hook

    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(before(fqn)))
        handles.append(module.register_forward_hook(after(fqn)))
    try:
        # GroupedMatmulShapes: MoE experts' float32 grouped matmul has no fake kernel (bf16 only).
        # FakeValuePolicy: values the model reads (XLM's .item(), MoE routing's nonzero).
        with torch.no_grad(), _compat.fake_tensor_mode(), GroupedMatmulShapes(), FakeValuePolicy():
            fake_batch = {name: _to_fake(value) for name, value in example_batch.items()}
            with flop_counter:
                output = model(**fake_batch, **_no_cache_kwargs(model))
    except Exception as error:
        raise PipelineCutError(
            f"dpipe could not run {type(model).__name__}'s forward on fake tensors to find its module "
            f"order ({type(error).__name__}: {error}); pass split_method='manual' split points and an "
            "example_batch the model accepts"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    return ModelTrace(
        call_index, forward_flops, flops_before, flop_counter.get_total_flops(), output_lengths, type(output)
    )


def _to_fake(value: Any) -> Any:
    # Inside FakeTensorMode, new tensors are fake; a copy turns a real input into one.
    return torch.empty_like(value).copy_(value) if isinstance(value, torch.Tensor) else value


def _no_cache_kwargs(model: nn.Module) -> dict[str, bool]:
    # A KV cache is useless in training and its object would cross stage boundaries.
    config = getattr(model, "config", None)
    return {"use_cache": False} if config is not None and hasattr(config, "use_cache") else {}
