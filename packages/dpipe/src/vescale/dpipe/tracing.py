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

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from vescale.dpipe import _compat
from vescale.dpipe.errors import PipelineCutError
from vescale.dtensor.batch_random import batch_layout, batch_with_doubled_rows, count_random_ops
from vescale.dtensor.deferred.fake_values import FakeValuePolicy
from vescale.dtensor.grouped_mm_shapes import GroupedMatmulShapes
from vescale.dtensor.model_state import model_state_kept

__all__ = [
    "ModelTrace",
    "default_example_batch",
    "no_cache_kwargs",
    "shapes_only_pass",
    "trace_model",
    "with_random_layout",
]


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
    # How many times each module ran (HRM's recurrent stacks run their blocks several times).
    call_counts: dict[str, int] = field(default_factory=dict)
    # Where the parameters of modules with submodules (Zaya's input scale on its model) are used:
    # the call index of the module started last at the first and the last use.
    parameter_uses: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Modules whose first call ran inside a custom autograd Function's forward, and that Function
    # (Reformer's reversible layers: one Function runs every block and recomputes them in backward).
    inside_autograd_function: dict[str, str] = field(default_factory=dict)
    # Random ops the forward ran (dropout in training mode): each stage then replays one device's.
    random_ops: int = 0
    # The shape of each random op's tensor, in order (for batch_layout).
    random_shapes: tuple[tuple[int, ...], ...] = ()
    # Where each random tensor holds the batch's rows (BatchPiece.layout; with_random_layout fills it).
    random_layout: tuple[tuple[int, int | None], ...] = ()


def default_example_batch(
    model: nn.Module, batch_size: int = 1, seq_len: int = 16
) -> dict[str, torch.Tensor]:
    """A batch of zero token ids, the input of a causal LM, sized to fit the model's positions.

    Only a positive ``max_position_embeddings`` caps the length: XLNet's is -1 (no limit).

    Example::

        batch = default_example_batch(model)
        assert batch["input_ids"].shape == (1, 16)
    """
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(max_positions, int) and max_positions > 0:
        seq_len = min(seq_len, max_positions)
    return {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long)}


def trace_model(model: nn.Module, example_batch: Mapping[str, Any]) -> ModelTrace:
    """Run ``model(**example_batch)`` once on fake tensors and record what ran.

    Example::

        trace = trace_model(model, default_example_batch(model))
        assert "lm_head" in trace.call_index
    """
    call_index: dict[str, int] = {}
    inside_autograd_function: dict[str, str] = {}
    forward_flops: dict[str, int] = {}
    flops_before: dict[str, int] = {}
    output_lengths: dict[str, int | None] = {}
    call_counts: dict[str, int] = {}
    flop_counter = FlopCounterMode(display=False)
    parameter_uses = _ParameterUses(model, call_index)

    def before(fqn: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            call_counts[fqn] = call_counts.get(fqn, 0) + 1
            if fqn not in call_index:
                call_index[fqn] = len(call_index)
                flops_before[fqn] = flop_counter.get_total_flops()
                function = _enclosing_autograd_function()
                if function is not None:
                    inside_autograd_function[fqn] = function

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
        # What the forward changes in the model (BigBird's attention swap) is undone: the run's
        # own first forward does it, as one device's does.
        with model_state_kept(model), shapes_only_pass():
            fake_batch = {name: _to_fake(value) for name, value in example_batch.items()}
            with flop_counter, parameter_uses, count_random_ops() as counted:
                output = model(**fake_batch, **no_cache_kwargs(model))
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
        call_index,
        forward_flops,
        flops_before,
        flop_counter.get_total_flops(),
        output_lengths,
        type(output),
        call_counts,
        parameter_uses.uses,
        inside_autograd_function,
        counted.random_ops,
        tuple(counted.shapes),
    )


def with_random_layout(model: nn.Module, example_batch: Mapping[str, Any], trace: ModelTrace) -> ModelTrace:
    """``trace`` with its :attr:`ModelTrace.random_layout`, learned from a second fake forward with the
    batch's rows doubled (only where the forward draws random numbers).

    Example::

        trace = with_random_layout(model, batch, trace_model(model, batch))
        trace.random_layout   # XLNet: ((3, 1), (4, 2)): sequence-first activations
    """
    if not trace.random_ops:
        return trace
    rows, doubled = batch_with_doubled_rows(example_batch)
    if not rows:
        return trace
    other = trace_model(model, doubled)
    layout = batch_layout(trace.random_shapes, rows, other.random_shapes, 2 * rows)
    return dataclasses.replace(trace, random_layout=layout)


@contextlib.contextmanager
def shapes_only_pass() -> Iterator[None]:
    """The context of a forward on fake tensors: no gradients, fake tensors, and what the model needs.

    ``GroupedMatmulShapes``: MoE experts' float32 grouped matmul has no fake kernel (bf16 only).
    ``FakeValuePolicy``: values the model reads (XLM's ``.item()``, MoE routing's ``nonzero``).
    ``dtensor_bookkeeping_outside_fake_mode``: a tensor-parallel model's DTensor ops (fused
    weights' ``_StridedShard`` offsets, strategies found through an op's decomposition).

    Example::

        with shapes_only_pass():
            output = model(input_ids=_to_fake(torch.zeros(1, 16, dtype=torch.long)))
    """
    with (
        torch.no_grad(),
        _compat.fake_tensor_mode(),
        _compat.dtensor_bookkeeping_outside_fake_mode(),
        GroupedMatmulShapes(),
        FakeValuePolicy(),
    ):
        yield


def _enclosing_autograd_function() -> str | None:
    """The name of the custom ``torch.autograd.Function`` whose ``forward`` is running, if any.

    Its ``forward`` is a static method given the Function's context as ``ctx``; the stack shows it.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "forward":
            context = frame.f_locals.get("ctx")
            if isinstance(context, torch.autograd.function.FunctionCtx):
                return type(context).__name__.removesuffix("Backward")
        frame = frame.f_back  # type: ignore[assignment]
    return None


_METADATA_READS = frozenset({"__get__", "size", "dim", "numel", "is_floating_point", "element_size"})


class _ParameterUses(TorchFunctionMode):
    """Records where the forward uses the parameters of modules that also have submodules.

    A position is the call index of the module started last when the parameter is used.
    """

    def __init__(self, model: nn.Module, call_index: dict[str, int]) -> None:
        super().__init__()
        self.call_index = call_index
        self.watched = {
            id(parameter): f"{fqn}.{name}" if fqn else name
            for fqn, module in model.named_modules()
            if any(True for _ in module.children())
            for name, parameter in module.named_parameters(recurse=False)
        }
        self.uses: dict[str, tuple[int, int]] = {}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # Reading metadata (XLNet's ``self.dtype`` walks every parameter) is not a use of the value.
        if self.watched and getattr(func, "__name__", None) not in _METADATA_READS:
            for leaf in tree_leaves((args, kwargs)):
                name = self.watched.get(id(leaf))
                if name is not None:
                    position = len(self.call_index) - 1
                    self.uses[name] = (self.uses.get(name, (position, position))[0], position)
        return func(*args, **kwargs)


def _to_fake(value: Any) -> Any:
    # Inside FakeTensorMode, new tensors are fake; a copy turns a real input into one.
    return torch.empty_like(value).copy_(value) if isinstance(value, torch.Tensor) else value


def no_cache_kwargs(model: nn.Module) -> dict[str, bool]:
    """``{"use_cache": False}`` for a model whose config has ``use_cache``, else ``{}``: every
    forward dpipe runs passes it (a KV cache is useless in training and would cross stages)."""
    config = getattr(model, "config", None)
    return {"use_cache": False} if config is not None and hasattr(config, "use_cache") else {}
