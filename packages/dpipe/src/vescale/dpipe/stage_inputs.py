"""Check, on fake tensors, that each stage needs nothing from earlier stages but the hidden state.

A stage after the first runs the model's whole forward with earlier stages' units skipped
(an embedding returns zeros, any other unit passes its input through) and swaps the received
hidden state in at its first module. Whatever else it computes from a skipped unit's output
is stale. A module before the blocks whose output only feeds the hidden stream (BLOOM's
``word_embeddings_layernorm``, BERT's embedding ``LayerNorm``) is therefore harmless; one whose
output also reaches a later block by another way (CPM-Ant's ``position_bias``, Gemma 3n's
per-layer inputs) would make the later stages silently wrong.

This module follows the data: one fake-tensor forward per stage after the first marks the
outputs of the earlier stages' units as stale, every operator passes the marks of its inputs
on to its outputs, and the hidden state that enters at the stage's first module starts clean.
If what the stage hands on (the next boundary's hidden state, or the model's output on the
last stage) carries a mark, :class:`~vescale.dpipe.errors.PipelineCutError` names the unit.

Example::

    layout = split_model(model, plan, trace)
    check_stage_inputs(model, layout, default_example_batch(model))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vescale.dpipe import _compat
from vescale.dpipe.errors import PipelineCutError
from vescale.dpipe.split import StageLayout
from vescale.dtensor.deferred.fake_values import FakeValuePolicy
from vescale.dtensor.grouped_mm_shapes import GroupedMatmulShapes

__all__ = ["check_stage_inputs"]


class _Provenance(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    """Marks each tensor with the units whose outputs it was computed from."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        # Keyed by id(); the marked tensors are kept alive for the one pass so no id is reused.
        self.sources: dict[int, frozenset[str]] = {}
        self._marked: list[torch.Tensor] = []

    def of(self, value: Any) -> frozenset[str]:
        marks: frozenset[str] = frozenset()
        for leaf in _tensor_leaves(value):
            marks |= self.sources.get(id(leaf), frozenset())
        return marks

    def fresh(self, tensor: torch.Tensor) -> torch.Tensor:
        """A new tensor of ``tensor``'s metadata that carries no marks."""
        copy = torch.empty_like(tensor)
        self.sources.pop(id(copy), None)
        return copy

    def mark(self, value: Any, marks: frozenset[str]) -> None:
        for leaf in _tensor_leaves(value):
            self.sources[id(leaf)] = self.sources.get(id(leaf), frozenset()) | marks
            self._marked.append(leaf)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        marks = self.of((args, kwargs))
        if marks:
            self.mark(output, marks)
            # An in-place or out= operator writes its marks into the tensors it mutates.
            schema = getattr(func, "_schema", None)
            for index, argument in enumerate(getattr(schema, "arguments", ())):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = args[index] if index < len(args) else kwargs.get(argument.name)
                    self.mark(value, marks)
        return output


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def check_stage_inputs(model: nn.Module, layout: StageLayout, example_batch: Mapping[str, Any]) -> None:
    """Raise if a stage after the first uses a value of an earlier stage other than its hidden state.

    Example::

        check_stage_inputs(model, split_model(model, plan, trace), default_example_batch(model))
    """
    for stage_index in range(1, layout.num_stages):
        _check_stage(model, layout, stage_index, example_batch)


def _check_stage(
    model: nn.Module, layout: StageLayout, stage_index: int, example_batch: Mapping[str, Any]
) -> None:
    provenance = _Provenance()
    entry_fqn = layout.boundaries[stage_index - 1]
    exit_fqn = layout.boundaries[stage_index] if stage_index < layout.num_stages - 1 else None
    sent: list[frozenset[str]] = []
    stale_units = {unit for unit, stage in layout.unit_stage.items() if stage < stage_index}

    def mark_output(unit_fqn: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            provenance.mark(output, frozenset({unit_fqn}))

        return hook

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The received hidden state: a fresh tensor with no marks, as in the running stage.
        if args and isinstance(args[0], torch.Tensor):
            return (provenance.fresh(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": provenance.fresh(kwargs["hidden_states"])}
        return None

    def leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden_state = args[0] if args else kwargs.get("hidden_states")
        sent.append(provenance.of(hidden_state))
        raise _StageEnd

    handles = [model.get_submodule(unit).register_forward_hook(mark_output(unit)) for unit in stale_units]
    handles.append(model.get_submodule(entry_fqn).register_forward_pre_hook(enter, with_kwargs=True))
    if exit_fqn is not None:
        handles.append(model.get_submodule(exit_fqn).register_forward_pre_hook(leave, with_kwargs=True))
    config = getattr(model, "config", None)
    model_kwargs = {"use_cache": False} if config is not None and hasattr(config, "use_cache") else {}
    try:
        with torch.no_grad(), _compat.fake_tensor_mode(), GroupedMatmulShapes(), FakeValuePolicy():
            fake_batch = {name: _fake(value) for name, value in example_batch.items()}
            with provenance:
                try:
                    output = model(**fake_batch, **model_kwargs)
                    final = (getattr(output, "loss", None), getattr(output, "logits", output))
                    sent.append(provenance.of(final))
                except _StageEnd:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    stale = sorted(sent[0] if sent else frozenset())
    if stale:
        modules = ", ".join(f"{unit!r} ({type(model.get_submodule(unit)).__name__})" for unit in stale)
        raise PipelineCutError(
            f"cannot split {type(model).__name__} before {entry_fqn!r}: stage {stage_index} uses the "
            f"output of {modules}, which runs on an earlier stage, other than through the hidden state "
            "that crosses the boundary (e.g. a position bias or per-layer input computed once before the "
            "blocks); only the hidden state travels between stages, so keep the pipeline to one stage "
            "for this model or cut where no such value is live"
        )


class _StageEnd(Exception):
    """Raised at the next stage's first module: this stage's output is its input."""


def _fake(value: Any) -> Any:
    return torch.empty_like(value).copy_(value) if isinstance(value, torch.Tensor) else value
