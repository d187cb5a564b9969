"""Run one pipeline stage of an unmodified model by running the model's own forward.

A stage calls the whole model's ``forward`` with the micro-batch's keyword arguments. The
units (blocks, embeddings, norms, heads) that belong to earlier stages are skipped (a block
passes its input through, an embedding returns zeros of its output shape); at the stage's
first module a forward pre-hook swaps the received hidden state in; at the next stage's
first module another pre-hook stops the forward by raising :class:`_StageExit` with that
module's input, which is what the stage sends on. Masks, position ids and rotary tables are
recomputed by each stage from the batch, exactly as the model computes them.

A unit's output that a later stage needs besides the hidden state (CPM-Ant's position bias,
Gemma 3n's per-layer inputs: :mod:`vescale.dpipe.stage_inputs` finds them) travels after the
hidden state, and on the later stage the skipped unit returns it instead of a stand-in.

Values that a model computes from *all* its layers at the end of the forward (the MoE
load-balancing loss of ``transformers``) are carried: a :class:`StageCarry` starts each stage
from what the previous stage sent (the first stage from nothing), accumulates while the
stage runs, and its value travels to the next stage after the hidden state. Being part of
the stage's output, its gradient comes back with the hidden state's.

Example::

    inputs = find_stage_inputs(model, layout, batch)
    router = StageRouter(model, layout, trace, local_stages=[1], inputs=inputs)
    stage_module = PipelineStageModule(model, router, stage_index=1, model_kwargs={"use_cache": False})
    hidden_out = stage_module(hidden_in, input_ids=input_ids)
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_leaves, tree_map_only

from vescale.dmodule.local_execution import keep_ancestors_on_dtensors
from vescale.dpipe.activation_meter import ActivationMeter
from vescale.dpipe.dtensor_boundary import from_wire, mesh_of, to_wire
from vescale.dpipe.errors import PipelineCutError
from vescale.dpipe.split import StageLayout
from vescale.dpipe.stage_inputs import CarriedOutput, StageInputs
from vescale.dpipe.tracing import ModelTrace

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineStageModule", "StageCarry", "StageRouter"]

_UNKNOWN = object()


class StageCarry(Protocol):
    """A value accumulated over the stages of one micro-batch's forward, sent after the hidden state.

    Example: :class:`vescale.dmodule.experts.RouterStatistics` (the routers' load-balancing
    statistics, which the last stage turns into the loss of every layer).
    """

    def start(self, received: torch.Tensor | None, batch: Mapping[str, Any]) -> None:
        """Before a stage's forward: the previous stage's value (``None`` on the first stage)."""

    def finish(self) -> torch.Tensor:
        """After it (also on error): the value to send on; the carry is idle again."""


class _StageExit(Exception):
    """Raised at the next stage's first module; carries the hidden state this stage sends on."""

    def __init__(self, hidden_state: torch.Tensor) -> None:
        super().__init__("pipeline stage boundary reached")
        self.hidden_state = hidden_state


def _hidden_state_of(module_fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden_states = kwargs.get("hidden_states")
    if isinstance(hidden_states, torch.Tensor):
        return hidden_states
    raise PipelineCutError(
        f"cannot cut before {module_fqn!r}: its first argument is not a tensor (nor is a "
        "'hidden_states' keyword), so there is no hidden state to pass between stages"
    )


def _free_parameter(module: nn.Module, name: str, device: torch.device | None) -> None:
    """Unregister ``module``'s parameter ``name``, leaving a stand-in of its shape and dtype."""
    parameter = module._parameters.pop(name)
    if parameter is None:
        return
    # A plain tensor attribute: no parameter, no state-dict entry, one element.
    stand_in = torch.zeros((), dtype=parameter.dtype, device=device or "cpu")
    setattr(module, name, stand_in.expand(parameter.shape))


class StageRouter:
    """Installs the skip, entry and exit logic on ``model`` and frees other stages' parameters.

    ``local_stages`` are the stage indices this rank runs; parameters of every other stage's
    units, and the loose parameters of the modules around the blocks that another stage owns,
    are unregistered (``model.parameters()`` then lists only this rank's) and their attributes
    hold a one-element stand-in on ``device`` with the parameter's shape and dtype, since model
    code outside the units reads them (Llama 4 moves the token ids to
    ``embed_tokens.weight.device`` on every stage; Zaya scales and shifts its embeddings).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: StageLayout,
        trace: ModelTrace,
        local_stages: list[int],
        device: torch.device | None = None,
        inputs: StageInputs | None = None,
    ) -> None:
        self.layout = layout
        self.inputs = inputs if inputs is not None else StageInputs(())
        self.active_stage: int | None = None
        self.received: torch.Tensor | None = None
        # While a stage runs: the carried outputs it received (returned by their skipped units),
        # and those of its own units that a later stage needs (recorded as they run).
        self.received_outputs: dict[str, Any] = {}
        self.recorded_outputs: dict[str, Any] = {}
        # Called once where a later stage's own part of the forward begins (its received hidden
        # state swapped in): the code before it re-runs earlier stages' glue on stand-ins.
        self.on_stage_entry: Callable[[], None] | None = None
        for unit_fqn, stage_index in layout.unit_stage.items():
            unit = model.get_submodule(unit_fqn)
            self._gate(unit_fqn, unit, stage_index, trace.output_lengths.get(unit_fqn))
            # A module holding a gated unit runs part of a stage: tensor parallelism's local
            # execution must not try it (its trial would run the gates and boundaries out of turn).
            keep_ancestors_on_dtensors(unit, "a unit of a pipeline stage")
        for boundary_index, boundary_fqn in enumerate(layout.boundaries):
            # Boundary k is where stage k ends and stage k + 1 starts.
            boundary = model.get_submodule(boundary_fqn)
            boundary.register_forward_pre_hook(
                self._boundary_hook(boundary_fqn, boundary_index), with_kwargs=True
            )
            keep_ancestors_on_dtensors(boundary, "a pipeline stage boundary")
        for unit_fqn, stage_index in layout.unit_stage.items():
            if stage_index not in local_stages:
                for module in model.get_submodule(unit_fqn).modules():
                    names = [
                        name for name, _ in module.named_parameters(recurse=False, remove_duplicate=False)
                    ]
                    for name in names:
                        _free_parameter(module, name, device)
        for parameter_fqn, stage_index in layout.loose_parameters.items():
            if stage_index not in local_stages:
                owner_fqn, _, name = parameter_fqn.rpartition(".")
                _free_parameter(model.get_submodule(owner_fqn), name, device)

    def _gate(self, unit_fqn: str, unit: nn.Module, unit_stage: int, output_length: int | None) -> None:
        original_forward = unit.forward
        router = self
        if isinstance(unit, nn.Embedding):
            embedding_dim, dtype = unit.embedding_dim, unit.weight.dtype

            def skipped(*args: Any, **kwargs: Any) -> Any:
                if args and isinstance(args[0], torch.Tensor):
                    return torch.zeros(*args[0].shape, embedding_dim, dtype=dtype, device=args[0].device)
                # An embedding subclass with its own arguments (BlenderBot's learned positions take
                # the input's shape): its own forward gives the shape; the value is never used.
                return original_forward(*args, **kwargs)
        elif isinstance(unit, nn.Linear):
            out_features, dtype = unit.out_features, unit.weight.dtype

            # RoCBert's input projection widens the concatenated embeddings: keep its output shape.
            def skipped(*args: Any, **kwargs: Any) -> Any:
                source = args[0] if args else next(iter(kwargs.values()))
                return torch.zeros(*source.shape[:-1], out_features, dtype=dtype, device=source.device)
        else:

            def skipped(*args: Any, **kwargs: Any) -> Any:
                hidden_state = args[0] if args else kwargs["hidden_states"]
                if output_length is None:
                    return hidden_state
                # The hidden state first, as the unit returns it; the rest (attention weights) unused.
                return (hidden_state, *(None,) * (output_length - 1))

        carried = unit_fqn in self.inputs.carried_units

        def gated_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if router.active_stage is not None and unit_stage < router.active_stage:
                # Received only by the stages that need it (or pass it on to one that does).
                if carried and unit_fqn in router.received_outputs:
                    return router.received_outputs[unit_fqn]
                return skipped(*args, **kwargs)
            output = original_forward(*args, **kwargs)
            if carried and router.active_stage == unit_stage:
                # Reduced now, for the model and the next stage alike: a vocab-parallel embedding's
                # output is a masked partial sum whose mask its first reduction releases.
                output = tree_map_only(DTensor, _reduced, output)
                router.recorded_outputs[unit_fqn] = output
            return output

        # An instance attribute shadows the class's forward; the model class stays untouched.
        unit.forward = types.MethodType(gated_forward, unit)

    def _boundary_hook(
        self, boundary_fqn: str, boundary_index: int
    ) -> Callable[
        [nn.Module, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]] | None
    ]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            if self.active_stage == boundary_index:
                raise _StageExit(_hidden_state_of(boundary_fqn, args, kwargs))
            if self.active_stage == boundary_index + 1:
                if self.on_stage_entry is not None:
                    entered, self.on_stage_entry = self.on_stage_entry, None
                    entered()
                if args and isinstance(args[0], torch.Tensor):
                    return (self.received, *args[1:]), kwargs
                _hidden_state_of(boundary_fqn, args, kwargs)
                return args, {**kwargs, "hidden_states": self.received}
            return None

        return hook


class PipelineStageModule(nn.Module):
    """The ``nn.Module`` that torch's ``PipelineStage`` runs for one stage of the model.

    Its parameters are the stage's own units'; while its :attr:`activation_meter` is enabled, it
    reports the bytes its last micro-batch forward saved for backward (parameters excluded) in
    :attr:`saved_activation_bytes`, and the meter counts what is in flight across micro-batches.
    """

    def __init__(
        self,
        model: nn.Module,
        router: StageRouter,
        stage_index: int,
        model_kwargs: dict[str, Any],
        activation_meter: ActivationMeter | None = None,
        carries: Sequence[StageCarry] = (),
    ) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.carries = tuple(carries)
        # Shared by the stages of a rank, so that its peak counts all of their micro-batches.
        self.activation_meter = activation_meter if activation_meter is not None else ActivationMeter()
        self.is_last = stage_index == router.layout.num_stages - 1
        self.saved_activation_bytes = 0
        # The last stage's logits of each forward, detached (the caller clears the list).
        self.logits: list[torch.Tensor] = []
        # The model is shared by all stages of a rank: keep it out of this module's children.
        self._stage_context = (model, router, model_kwargs)
        self.units = nn.ModuleDict(
            {fqn.replace(".", "/"): model.get_submodule(fqn) for fqn in router.layout.units_of(stage_index)}
        )
        self._mesh: object = _UNKNOWN  # the mesh of the stage's DTensor parameters, found on first call

    def forward(self, *received: torch.Tensor, **batch: Any) -> Any:
        model, router, model_kwargs = self._stage_context
        # A tensor-parallel stage receives plain tensors and runs on DTensors (see dtensor_boundary).
        if self._mesh is _UNKNOWN:
            # Parallelized before the first call and fixed since: look once, not per micro-batch.
            self._mesh = mesh_of(self)
        mesh = cast("DeviceMesh | None", self._mesh)
        hidden_state = from_wire(_with_contiguous_gradient(received[0]), mesh) if received else None
        incoming = router.inputs.received_by(self.stage_index)
        count = sum(len(output.tensor_leaves) for output in incoming)
        received_outputs = _rebuild(incoming, received[1 : 1 + count], mesh)
        carried = received[1 + count :]
        for index, carry in enumerate(self.carries):
            carry.start(carried[index] if index < len(carried) else None, batch)
        router.active_stage, router.received = self.stage_index, hidden_state
        router.received_outputs, router.recorded_outputs = received_outputs, {}
        saved_storages: dict[int, int] = {}
        exit_state: torch.Tensor | None = None
        try:
            with self.activation_meter.recording(self.parameters) as saved_storages:
                output = model(**batch, **model_kwargs)
        except _StageExit as stage_exit:
            exit_state = stage_exit.hidden_state
        finally:
            outputs = {**router.received_outputs, **router.recorded_outputs}
            router.active_stage, router.received = None, None
            router.received_outputs, router.recorded_outputs = {}, {}
            if self.activation_meter.enabled:
                self.saved_activation_bytes = sum(saved_storages.values())
            # A clone: a stage without routers would otherwise send back its own input tensor.
            sent = tuple(carry.finish().clone() for carry in self.carries)
        if exit_state is not None:
            onward = router.inputs.received_by(self.stage_index + 1)
            # Contiguous: gloo sends and receives only contiguous buffers, laid out as what is sent.
            return (to_wire(exit_state).contiguous(), *_to_wire_outputs(onward, outputs), *sent)
        if not self.is_last:
            raise PipelineCutError(
                f"stage {self.stage_index} ran to the end of the model's forward without reaching "
                f"{router.layout.boundaries[self.stage_index]!r}; the model skipped that module for "
                "this input, so it cannot be cut there"
            )
        loss = to_wire(getattr(output, "loss", None))
        logits = to_wire(getattr(output, "logits", output))
        self.logits.append(logits.detach())
        return (loss, logits) if loss is not None else logits


def _rebuild(incoming: Sequence[CarriedOutput], wires: Sequence[torch.Tensor], mesh: Any) -> dict[str, Any]:
    """The received unit outputs, rebuilt to what each unit returns (DTensors wrapped again)."""
    rebuilt: dict[str, Any] = {}
    offset = 0
    for carried in incoming:
        tensors = []
        for index, position in enumerate(carried.tensor_leaves):
            # A copy: model code may change the value in place (XLM masks its hidden state).
            wire = _with_contiguous_gradient(wires[offset + index]).clone()
            tensors.append(from_wire(wire, mesh) if position in carried.dtensor_leaves else wire)
        offset += len(tensors)
        rebuilt[carried.unit] = carried.rebuild(tensors)
    return rebuilt


def _reduced(tensor: DTensor) -> DTensor:
    """``tensor`` with its partial placements made Replicate (unchanged if it has none)."""
    placements = [Replicate() if placement.is_partial() else placement for placement in tensor.placements]
    if placements == list(tensor.placements):
        return tensor
    return tensor.redistribute(tensor.device_mesh, placements)


def _with_contiguous_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a received activation), its gradient made contiguous.

    PyTorch's pipeline stage lays out the buffer that receives a gradient like the gradient the
    other stage computed, and gloo receives only into contiguous buffers (Zamba's carried
    embeddings get a transposed gradient). The hook is registered once per receive buffer.
    """
    if tensor.requires_grad and not getattr(tensor, "_dpipe_contiguous_gradient", False):
        tensor.register_hook(lambda gradient: gradient.contiguous())  # type: ignore[no-untyped-call]
        tensor._dpipe_contiguous_gradient = True  # type: ignore[attr-defined]
    return tensor


def _to_wire_outputs(onward: Sequence[CarriedOutput], outputs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensor leaves of the unit outputs the next stage needs, as plain contiguous tensors (cloned:
    one of them may be the hidden state itself, or an input of this stage passed on)."""
    wires: list[torch.Tensor] = []
    for carried in onward:
        if carried.unit not in outputs:
            raise PipelineCutError(
                f"unit {carried.unit!r} did not run before the stage boundary, so its output cannot "
                "travel to the next stage; cut after it"
            )
        leaves = tree_leaves(outputs[carried.unit])
        for position in carried.tensor_leaves:
            leaf = to_wire(leaves[position])
            # Contiguous: the gradient buffer that comes back is laid out like what was sent.
            if leaf is leaves[position]:
                leaf = leaf.clone(memory_format=torch.contiguous_format)
            wires.append(leaf.contiguous())
    return wires
