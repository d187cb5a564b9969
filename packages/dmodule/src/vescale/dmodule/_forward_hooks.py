"""Forward hooks that put a module's inputs and outputs into the placements its plan names.

A DTensor is redistributed (a no-op when it already has the placements). A plain tensor is
taken as the *full* tensor, the same on every rank, as single-device code passes it, and
becomes a DTensor by local slicing (no communication): Replicate stays whole, Shard cuts the
rank's chunk. A plain tensor cannot become Partial (nothing says how its sum is split).
Inputs are named by position or by keyword; a name the caller passed by position is found
through the signature of the module's ``forward``. Outputs are named by position (a single
tensor is position 0; tuples and ``ModelOutput``s by index) or by key.

Inputs go through an :class:`InputConversionCache` shared by all hooks of one DModule and
emptied at each root forward: sibling modules fed the same tensor in the same placements (the
q, k and v projections reading one normalised hidden state) share one conversion, so its
backward reduces their summed gradient once, as Megatron's ``f`` operator does, instead of
once per consumer.

Example::

    replicated = ForwardPlacements(args=((Replicate(),),))
    hooks = register_forward_placement_hooks(block, mesh, inputs=replicated, outputs=None, fqn="layers.0")
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from vescale.dmodule._local_boundaries import current_boundaries
from vescale.dmodule.errors import DModuleError
from vescale.dmodule.sharding_plan import ForwardPlacements, TensorPlacements
from vescale.dtensor.placements import placement_to_string, to_torch_placements

__all__ = ["InputConversionCache", "convert_to_placements", "register_forward_placement_hooks"]


def convert_to_placements(value: Any, mesh: DeviceMesh, placements: TensorPlacements, where: str) -> Any:
    """``value`` in ``placements`` on ``mesh``; anything that is not a tensor is returned as it is.

    Example::

        hidden = convert_to_placements(hidden, mesh, (Replicate(), Shard(1)), "model.layers.0 input 0")
    """
    if not isinstance(value, torch.Tensor):
        return value
    boundaries = current_boundaries()
    if boundaries is not None:  # inside a module that runs, or is verified to run, on local tensors
        return boundaries.convert(value, mesh, placements, where, _convert_tensor)
    return _convert_tensor(value, mesh, placements, where)


def _convert_tensor(value: torch.Tensor, mesh: DeviceMesh, placements: TensorPlacements, where: str) -> Any:
    target = to_torch_placements(placements)
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:
            raise DModuleError(
                f"{where}: the tensor lives on mesh {value.device_mesh} but the plan places it on {mesh}; "
                "parallelize the producing module on the same mesh"
            )
        if any(placement.is_partial() for placement in value.placements):
            return _ReducePartial.apply(value, mesh, tuple(target))  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        # Even when the placements already agree: the redistribution's backward returns the
        # gradient in these placements (Megatron's "identity forward, all-reduce backward").
        return value.redistribute(mesh, target)
    if any(isinstance(placement, Partial) for placement in target):
        raise DModuleError(
            f"{where}: a plain tensor cannot be made Partial "
            f"([{', '.join(placement_to_string(p) for p in target)}]); give it 'R' or a Shard"
        )
    replicated = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if all(isinstance(placement, Replicate) for placement in target):
        return replicated
    return replicated.redistribute(mesh, target)


class _ReducePartial(torch.autograd.Function):
    """``value.redistribute(mesh, target)`` for a Partial ``value``, whose gradient is Replicate there.

    The gradient of a sum's terms is the gradient of the sum, whole on every rank. PyTorch's own
    redistribution hands a Replicate gradient back as Replicate, but a gradient that arrives
    Partial (replicated activations next to sharded ones sum their gradients that way) it tries
    to turn into the input's partial type: for a vocabulary-parallel embedding's masked partial
    output that fails ("Redistribution from one partial type (P(sum)) to another (MaskP ...)"),
    OLMo2's tensor-parallel backward among others. Reducing it to Replicate is the single-device
    gradient in every case.
    """

    @staticmethod
    def forward(ctx: Any, value: DTensor, mesh: DeviceMesh, target: tuple[Any, ...]) -> DTensor:
        ctx.mesh = mesh
        ctx.gradient_placements = tuple(
            Replicate() if placement.is_partial() else placement for placement in value.placements
        )
        return value.redistribute(mesh, target)

    @staticmethod
    def backward(ctx: Any, gradient: DTensor) -> tuple[DTensor, None, None]:
        return gradient.redistribute(ctx.mesh, ctx.gradient_placements), None, None


class InputConversionCache:
    """Conversions of module inputs done in the current forward, by input tensor and target.

    A hit needs the same tensor object, unmodified since (its version counter), on the same mesh
    with the same target placements. :meth:`clear` runs before and after every root forward, so
    no conversion outlives the forward (and autograd graph) that made it.

    Example::

        cache = InputConversionCache()
        q_in = cache.convert(hidden, mesh, ("R",), "q_proj input 0")
        assert cache.convert(hidden, mesh, ("R",), "k_proj input 0") is q_in
    """

    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Inside a compiled_call (see _convert_compiling): no-op conversions by input tensor.
        self._compiled_entries: dict[torch.Tensor, Any] | None = None

    def convert(self, value: Any, mesh: DeviceMesh, placements: TensorPlacements, where: str) -> Any:
        """``convert_to_placements(value, ...)``, reusing this forward's earlier identical conversion."""
        if not isinstance(value, torch.Tensor):
            return value
        if torch.compiler.is_compiling():
            return self._convert_compiling(value, mesh, placements, where)
        # A trial or local run of a module (local execution) converts among its own values only:
        # a plain input reaches both trial runs as the same tensor, as a DTensor in one of them.
        key = (mesh, tuple(to_torch_placements(placements)), current_boundaries())
        by_target = self._entries.setdefault(value, {})  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        version, converted = by_target.get(key, (None, None))
        if converted is None or version != value._version:
            converted = convert_to_placements(value, mesh, placements, where)
            by_target[key] = (value._version, converted)
        return converted

    def _convert_compiling(
        self, value: torch.Tensor, mesh: DeviceMesh, placements: TensorPlacements, where: str
    ) -> Any:
        # Dynamo traces neither weak dictionaries nor version counters, but it does trace a plain
        # dictionary keyed by tensors, made inside the compiled call (a dictionary from outside
        # would return its entries as extra graph outputs that need gradients and get none).
        # Shared: conversions that change no value (a DTensor already in the target placements,
        # whose conversion only sets its gradient's placements), so that sharing one stays right
        # after an in-place change of the input (the conversion's local tensor is the input's
        # own). Others, and every one outside a compiled_call, convert per consumer: the same
        # values, each consumer's gradient reduced on its own.
        entries = self._compiled_entries
        target = tuple(to_torch_placements(placements))
        already_placed = (
            isinstance(value, DTensor)
            and value.device_mesh == mesh
            and tuple(value.placements) == target
            and not any(placement.is_partial() for placement in target)
        )
        if entries is None or not already_placed:
            return convert_to_placements(value, mesh, placements, where)
        converted = entries.get(value)
        if converted is None:
            converted = convert_to_placements(value, mesh, placements, where)
            entries[value] = converted
        return converted

    def compiled_call(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``forward(*args, **kwargs)``, sharing no-op conversions within it; for compiled code to call.

        Example::

            block.forward = torch.compile(functools.partial(cache.compiled_call, block.forward))
        """
        outer = self._compiled_entries
        self._compiled_entries = {}
        try:
            return forward(*args, **kwargs)
        finally:
            self._compiled_entries = outer

    def clear(self) -> None:
        """Forget every conversion (called around each root forward)."""
        self._entries = WeakIdKeyDictionary()


def _positional_index(module: nn.Module, name: str) -> int | None:
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, parameter in enumerate(parameters):
        if parameter.name == name and parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            return index
    return None


def _convert_inputs(
    module: nn.Module,
    mesh: DeviceMesh,
    spec: ForwardPlacements,
    fqn: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cache: InputConversionCache,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    arg_list = list(args)
    for index, placements in enumerate(spec.args):
        if placements is not None and index < len(arg_list):
            arg_list[index] = cache.convert(
                arg_list[index], mesh, placements, f"{fqn or '<root>'} input {index}"
            )
    for name, placements in spec.kwargs:
        if placements is None:
            continue
        where = f"{fqn or '<root>'} input {name!r}"
        if name in kwargs:
            kwargs[name] = cache.convert(kwargs[name], mesh, placements, where)
            continue
        position = _positional_index(module, name)
        if position is not None and position < len(arg_list):
            arg_list[position] = cache.convert(arg_list[position], mesh, placements, where)
    return tuple(arg_list), kwargs


def _convert_outputs(output: Any, mesh: DeviceMesh, spec: ForwardPlacements, fqn: str) -> Any:
    where = f"{fqn or '<root>'} output"
    if isinstance(output, torch.Tensor):
        placements = spec.args[0] if spec.args else None
        return output if placements is None else convert_to_placements(output, mesh, placements, f"{where} 0")
    if isinstance(
        output, dict
    ):  # ModelOutput is an OrderedDict; assigning by key keeps its attributes in step
        keys = list(output.keys())
        for index, placements in enumerate(spec.args):
            if placements is not None and index < len(keys):
                output[keys[index]] = convert_to_placements(
                    output[keys[index]], mesh, placements, f"{where} {index}"
                )
        for name, placements in spec.kwargs:
            if placements is not None and name in output:
                output[name] = convert_to_placements(output[name], mesh, placements, f"{where} {name!r}")
        return output
    if isinstance(output, Sequence) and not isinstance(output, str):
        items = list(output)
        for index, placements in enumerate(spec.args):
            if placements is not None and index < len(items):
                items[index] = convert_to_placements(items[index], mesh, placements, f"{where} {index}")
        return type(output)(items) if isinstance(output, tuple | list) else items
    return output


def _name(module: nn.Module, fqn: str) -> str:
    """How messages name ``module``: its FQN, or its class where ``torch.compile`` traces the hook.

    Dynamo guards on every string the traced code reads, and the FQNs of the blocks of one model
    differ: read there, they would compile each block on its own (dynamo's own error then names
    the module's line).
    """
    return type(module).__name__ if torch.compiler.is_compiling() else fqn


def register_forward_placement_hooks(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    inputs: ForwardPlacements | None,
    outputs: ForwardPlacements | None,
    fqn: str,
    cache: InputConversionCache | None = None,
) -> list[RemovableHandle]:
    """Hooks that convert ``module``'s inputs and outputs as the plan says; their handles.

    ``cache`` is shared by the hooks of one DModule (see :class:`InputConversionCache`); without
    one, each hook converts on its own.

    Example::

        sharded = ForwardPlacements(args=((Shard(-1),),))
        hooks = register_forward_placement_hooks(lm_head, mesh, inputs=None, outputs=sharded, fqn="lm_head")
    """
    cache = cache if cache is not None else InputConversionCache()
    handles = []
    if inputs is not None:

        def convert_inputs(
            hooked: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return _convert_inputs(hooked, mesh, inputs, _name(hooked, fqn), args, kwargs, cache)

        handles.append(module.register_forward_pre_hook(convert_inputs, with_kwargs=True))
    if outputs is not None:

        def convert_outputs(hooked: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return _convert_outputs(output, mesh, outputs, _name(hooked, fqn))

        handles.append(module.register_forward_hook(convert_outputs))
    return handles
