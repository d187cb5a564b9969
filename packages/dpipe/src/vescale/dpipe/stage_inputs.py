"""Find, on fake tensors, which values of earlier stages a pipeline stage uses besides its hidden state.

A stage after the first runs the model's whole forward with earlier stages' units skipped
(an embedding returns zeros, any other unit passes its input through) and swaps the received
hidden state in at its first module. Whatever else it computes from a skipped unit's output
is stale. A module before the blocks whose output only feeds the hidden stream (BLOOM's
``word_embeddings_layernorm``, BERT's embedding ``LayerNorm``) is therefore harmless; one whose
output also reaches a later block by another way (CPM-Ant's ``position_bias``, Gemma 3n's
per-layer inputs, Zamba's original embeddings that its shared block reads at every layer)
must reach the later stage itself: its output is *carried*, sent after the hidden state, and
the skipped unit returns the value it received instead of a stand-in.

This module follows the data: one fake-tensor forward per stage after the first marks the
output of each earlier stage's unit with that unit (and only it: a carried output is right
whatever its inputs were), every operator passes the marks of its inputs on to its outputs,
and the hidden state that enters at the stage's first module starts clean. The units whose
marks reach what the stage hands on (the next boundary's hidden state, or the model's output
on the last stage) are the ones it needs; a stage also receives, to pass them on, what later
stages need from before it. A needed unit that runs more than once per forward has no single
output to carry: :class:`~vescale.dpipe.errors.PipelineCutError` names it.

Example::

    layout = split_model(model, plan, trace)
    inputs = find_stage_inputs(model, layout, default_example_batch(model))
    print([output.unit for output in inputs.received_by(1)])   # e.g. ['cpmant.position_bias']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from vescale.dpipe import _compat
from vescale.dpipe.errors import PipelineCutError
from vescale.dpipe.split import StageLayout
from vescale.dpipe.tracing import no_cache_kwargs, shapes_only_pass
from vescale.dtensor.model_state import model_state_kept

__all__ = ["CarriedOutput", "StageInputs", "find_stage_inputs"]


@dataclass(frozen=True)
class CarriedOutput:
    """A unit's output that a later stage needs besides the hidden state, and its structure.

    ``spec`` and ``constants`` rebuild the output (a tuple, a ``ModelOutput``) around the tensor
    leaves that travel: ``tensor_leaves`` are their positions among the flattened leaves, and
    ``dtensor_leaves`` those of them that were DTensors (a tensor-parallel model), which the
    receiver wraps again; ``integer_leaves`` those that are not floating point (they travel
    only where PyTorch's shape inference runs on zeros: see :func:`find_stage_inputs`).
    """

    unit: str
    spec: TreeSpec
    constants: tuple[Any, ...]
    tensor_leaves: tuple[int, ...]
    dtensor_leaves: frozenset[int]
    integer_leaves: frozenset[int]

    def rebuild(self, tensors: list[Any]) -> Any:
        """The unit's output with ``tensors`` (in ``tensor_leaves`` order) in place."""
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_leaves, tensors, strict=True):
            leaves[position] = tensor
        return tree_unflatten(leaves, self.spec)


@dataclass(frozen=True)
class StageInputs:
    """What each stage receives besides the hidden state: ``received[s]`` for stage ``s``."""

    received: tuple[tuple[CarriedOutput, ...], ...]

    def received_by(self, stage_index: int) -> tuple[CarriedOutput, ...]:
        """The outputs stage ``stage_index`` receives, in the order they travel (none past the last)."""
        return self.received[stage_index] if stage_index < len(self.received) else ()

    @property
    def carried_units(self) -> frozenset[str]:
        return frozenset(output.unit for outputs in self.received for output in outputs)


class _Provenance(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    """Marks each tensor with the units whose outputs it was computed from."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        # Keyed by id(); the marked tensors are kept alive for the one pass so no id is reused.
        self.sources: dict[int, frozenset[str]] = {}
        self._marked: list[torch.Tensor] = []
        # The earlier stage's units now running: what they compute inside is theirs too.
        self.running: list[str] = []

    def of(self, value: Any) -> frozenset[str]:
        marks: frozenset[str] = frozenset()
        for leaf in _tensor_leaves(value):
            marks |= self.sources.get(id(leaf), frozenset())
        return marks

    def fresh(self, tensor: torch.Tensor) -> torch.Tensor:
        """A new tensor of ``tensor``'s metadata that carries no marks."""
        copy = torch.empty_like(tensor)
        # A DTensor's local tensor too: empty_like ran on it here and took the input's marks.
        for leaf in _tensor_leaves(copy):
            self.sources.pop(id(leaf), None)
        return copy

    def mark(self, value: Any, marks: frozenset[str], replace: bool = False) -> None:
        for leaf in _tensor_leaves(value):
            old = frozenset() if replace else self.sources.get(id(leaf), frozenset())
            self.sources[id(leaf)] = old | marks
            self._marked.append(leaf)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        marks = self.of((args, kwargs))
        if self.running:
            marks |= {_INSIDE + self.running[-1]}
        if marks:
            self.mark(output, marks)
            # An in-place or out= operator writes its marks into the tensors it mutates.
            schema = getattr(func, "_schema", None)
            for index, argument in enumerate(getattr(schema, "arguments", ())):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = args[index] if index < len(args) else kwargs.get(argument.name)
                    self.mark(value, marks)
        return output


# The mark of a value computed inside a unit: its output is carried, its other values are not.
_INSIDE = "inside:"


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``; a DTensor's local tensor too, since the dispatch mode sees only the
    operators on local tensors (a tensor-parallel stage's values would otherwise carry no marks)."""
    leaves: list[torch.Tensor] = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, DTensor):
            # Under no_grad (the pass runs under it), to_local() is the DTensor's own local tensor.
            leaves.append(leaf.to_local())
        if isinstance(leaf, torch.Tensor):
            leaves.append(leaf)
    return leaves


def find_stage_inputs(model: nn.Module, layout: StageLayout, example_batch: Mapping[str, Any]) -> StageInputs:
    """The unit outputs each stage needs from earlier stages besides the hidden state.

    Example::

        inputs = find_stage_inputs(model, split_model(model, plan, trace), default_example_batch(model))
    """
    needed: dict[int, set[str]] = {}
    outputs: dict[str, CarriedOutput] = {}
    for stage_index in range(1, layout.num_stages):
        needed[stage_index] = _needed_by_stage(model, layout, stage_index, example_batch, outputs)
    # A stage also receives what a later stage needs from before it, to pass it on.
    received: list[set[str]] = [set() for _ in range(layout.num_stages)]
    for stage_index in range(layout.num_stages - 1, 0, -1):
        later = received[stage_index + 1] if stage_index + 1 < layout.num_stages else set()
        received[stage_index] = needed[stage_index] | {
            unit for unit in later if layout.unit_stage[unit] < stage_index
        }
    order = list(layout.unit_stage)
    return StageInputs(
        tuple(tuple(outputs[unit] for unit in sorted(units, key=order.index)) for units in received)
    )


def _needed_by_stage(
    model: nn.Module,
    layout: StageLayout,
    stage_index: int,
    example_batch: Mapping[str, Any],
    outputs: dict[str, CarriedOutput],
) -> set[str]:
    provenance = _Provenance()
    entry_fqn = layout.boundaries[stage_index - 1]
    exit_fqn = layout.boundaries[stage_index] if stage_index < layout.num_stages - 1 else None
    sent: list[frozenset[str]] = []
    stale_units = {unit for unit, stage in layout.unit_stage.items() if stage < stage_index}
    calls: dict[str, int] = {}

    def start_unit(unit_fqn: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            provenance.running.append(unit_fqn)

        return hook

    def mark_output(unit_fqn: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            provenance.running.pop()
            calls[unit_fqn] = calls.get(unit_fqn, 0) + 1
            if unit_fqn not in outputs:
                outputs[unit_fqn] = _describe(unit_fqn, output)
            provenance.mark(output, frozenset({unit_fqn}), replace=True)

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
    handles += [model.get_submodule(unit).register_forward_pre_hook(start_unit(unit)) for unit in stale_units]
    handles.append(model.get_submodule(entry_fqn).register_forward_pre_hook(enter, with_kwargs=True))
    if exit_fqn is not None:
        handles.append(model.get_submodule(exit_fqn).register_forward_pre_hook(leave, with_kwargs=True))
    model_kwargs = no_cache_kwargs(model)
    try:
        with model_state_kept(model), shapes_only_pass():  # the model as it was, after (tracing.py)
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
    needed = set(sent[0]) if sent else set()
    # Where dpipe's stages learn shapes on zeros (every valid index), an index travels too.
    integers_travel = _compat.pipeline_stage_class() is not PipelineStage
    units = {mark for mark in needed if not mark.startswith(_INSIDE)}
    refusals = (
        (
            sorted(mark[len(_INSIDE) :] for mark in needed if mark.startswith(_INSIDE)),
            "a value that {modules} computes on an earlier stage but does not return (e.g. keys and "
            "values shared between layers through a cache or a dict), so it cannot travel with the "
            "hidden state",
        ),
        (
            [] if integers_travel else sorted(unit for unit in units if outputs[unit].integer_leaves),
            "an integer tensor that {modules} returns on an earlier stage (e.g. top-k indices shared "
            "between layers); this torch's pipeline stage learns shapes by running each stage once on "
            "uninitialised tensors, which an index cannot survive, so only floating-point values "
            "travel between stages (torch >= 2.13 lifts this)",
        ),
        (
            sorted(unit for unit in units if calls.get(unit, 0) > 1),
            "the output of {modules}, which runs on an earlier stage and more than once per forward, "
            "so no single value of it can travel to the later stage",
        ),
    )
    for refused, reason in refusals:
        if refused:
            modules = ", ".join(f"{unit!r} ({type(model.get_submodule(unit)).__name__})" for unit in refused)
            raise PipelineCutError(
                f"cannot split {type(model).__name__} before {entry_fqn!r}: stage {stage_index} uses "
                f"{reason.format(modules=modules)}; keep the pipeline to one stage for this model or "
                "cut before that module"
            )
    return needed


def _describe(unit: str, output: Any) -> CarriedOutput:
    leaves, spec = tree_flatten(output)
    tensor_leaves = tuple(index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    constants = tuple(None if index in tensor_leaves else leaf for index, leaf in enumerate(leaves))
    dtensor_leaves = frozenset(index for index in tensor_leaves if isinstance(leaves[index], DTensor))
    integer_leaves = frozenset(index for index in tensor_leaves if not leaves[index].is_floating_point())
    return CarriedOutput(unit, spec, constants, tensor_leaves, dtensor_leaves, integer_leaves)


class _StageEnd(Exception):
    """Raised at the next stage's first module: this stage's output is its input."""


def _fake(value: Any) -> Any:
    return torch.empty_like(value).copy_(value) if isinstance(value, torch.Tensor) else value
