"""The check behind local execution: one forward and backward as DTensors, one on local tensors, compared.

:func:`compare_runs` runs a module's forward twice on detached copies of its inputs, under the
same random state and with its own saved-tensor hooks (so activation checkpointing around the
module never sees these trial runs). The trials run on stand-ins, not on the module's values:
every floating-point DTensor parameter and input (not Partial) is replaced by random values in
its layout, the same on every rank, so that a value that happens to be zero now (a freshly
initialised bias, which a row-parallel linear would add once per rank on local tensors) cannot
make two different computations agree:

* **as DTensors**, with the plan's conversions inside recorded; a backward from a fixed random
  cotangent per output (Partial outputs get a Replicate one, as ``from_local`` hands them back)
  gives the placements of every input's and parameter's gradient;
* **on local tensors**, the inputs entering through ``to_local`` and the parameters swapped for
  their local shards (:class:`SwappedParameters`), each with the gradient placements just
  recorded, the conversions replayed; the same cotangents, as local tensors.

Outputs and gradients must agree bitwise, in placements and values. The answer is the recorded
layouts, or a sentence saying what differed.

Example::

    result = compare_runs(block, leaves, spec, parameter_slots(block), BoundaryRecording())
    if isinstance(result, str):
        print("stays DTensor:", result)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree

from vescale.dmodule._local_boundaries import (
    BoundaryRecording,
    BoundaryReplay,
    TensorLayout,
    running_boundaries,
)
from vescale.dtensor.implicit_replication import suspended_implicit_replication

__all__ = ["SIMPLE_VALUES", "SwappedParameters", "compare_runs", "parameter_slots", "trial_running"]

GradientPlacements = tuple[Any, ...] | None
SlotKey = tuple[int, str]
# Non-tensor values an input or output may hold: compared and keyed by value.
SIMPLE_VALUES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
_COTANGENT_SEED = 0x5EED
_PARAMETER_SEED = 0x9A4A


def parameter_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(owner, name)`` of every parameter of ``module``'s subtree, each slot once."""
    seen: set[SlotKey] = set()
    slots = []
    for owner in module.modules():
        for name, parameter in owner._parameters.items():
            if parameter is not None and (id(owner), name) not in seen:
                seen.add((id(owner), name))
                slots.append((owner, name))
    return slots


class SwappedParameters:
    """Parameters replaced by their local shards (each tied tensor once) until :meth:`restore`.

    Example::

        swapped = SwappedParameters([(block.attn, "q_norm_weight", (Partial(),))])
        try:
            block.forward(local_hidden)
        finally:
            swapped.restore()
    """

    def __init__(
        self,
        slots: Iterable[tuple[nn.Module, str, GradientPlacements]],
        stand_ins: dict[int, DTensor] | None = None,
        *,
        local: bool = True,
    ) -> None:
        """``stand_ins`` (by ``id`` of a parameter) take the parameters' place, as DTensors when
        ``local`` is false (the trial's DTensor run), else as their local shards."""
        self._saved: list[tuple[nn.Module, str, Any]] = []
        replacements: dict[int, torch.Tensor] = {}
        try:
            for owner, name, gradient in slots:
                parameter = owner._parameters.get(name)
                if not isinstance(parameter, DTensor):
                    continue
                replacement = replacements.get(id(parameter))
                if replacement is None:
                    source = parameter if stand_ins is None else stand_ins.get(id(parameter), parameter)
                    replacement = source.to_local(grad_placements=gradient) if local else source
                    replacements[id(parameter)] = replacement
                self._saved.append((owner, name, parameter))
                owner._parameters[name] = replacement  # for this forward only
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        for owner, name, parameter in reversed(self._saved):
            owner._parameters[name] = parameter
        self._saved = []


@contextlib.contextmanager
def _trial(device_type: str) -> Iterator[None]:
    """Gradients on, the random state put back afterwards, saved tensors kept by the trial itself."""
    devices: list[int] = []
    if device_type != "cpu":
        devices = [torch.get_device_module(device_type).current_device()]
    with (
        torch.random.fork_rng(devices=devices, device_type=device_type),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(lambda saved: saved, lambda saved: saved),
    ):
        yield


def _random_like(value: DTensor, seed: int) -> DTensor:
    """A DTensor of ``value``'s layout holding values drawn from ``seed``, the same on every rank
    (drawn whole, then cut: Shard placements need no communication)."""
    generator = torch.Generator().manual_seed(seed)
    local_device = value.to_local().device
    full = torch.randn(tuple(value.shape), generator=generator).to(dtype=value.dtype, device=local_device)
    mesh = value.device_mesh
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, value.placements)


def _stand_in(value: torch.Tensor, seed: int) -> Any:
    """What the trial runs on in place of ``value``: random values in its layout for a floating-point
    DTensor that is not Partial (a zero bias would hide a bias counted once per rank), else
    ``value`` itself, detached."""
    if (
        isinstance(value, DTensor)
        and value.is_floating_point()
        and not any(placement.is_partial() for placement in value.placements)
    ):
        stand_in: torch.Tensor = _random_like(value, seed)
    else:
        stand_in = value.detach()
    return stand_in.requires_grad_(value.requires_grad)


def _cotangent(output: torch.Tensor, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_COTANGENT_SEED - 1 - index)
    local_device = output.to_local().device if isinstance(output, DTensor) else output.device
    full = torch.randn(tuple(output.shape), generator=generator).to(dtype=output.dtype, device=local_device)
    if not isinstance(output, DTensor):
        return full
    mesh = output.device_mesh
    placements = [Replicate() if placement.is_partial() else placement for placement in output.placements]
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, placements)


def _gradients(
    outputs: list[torch.Tensor], targets: list[torch.Tensor], cotangents: list[torch.Tensor]
) -> list[Any]:
    if not outputs or not targets:
        return [None] * len(targets)
    # Not under the implicit-replication mode, which would take local outputs mixed with DTensor
    # targets for Replicate values.
    with suspended_implicit_replication():
        return list(torch.autograd.grad(outputs, targets, cotangents, allow_unused=True))


def _same(first: Any, second: Any) -> bool:
    if isinstance(first, DTensor) or isinstance(second, DTensor):
        return (
            isinstance(first, DTensor)
            and isinstance(second, DTensor)
            and tuple(first.placements) == tuple(second.placements)
            and _same(first.to_local(), second.to_local())
        )
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return (
            isinstance(first, torch.Tensor)
            and isinstance(second, torch.Tensor)
            and first.shape == second.shape
            and first.dtype == second.dtype
            and torch.equal(first, second)
        )
    return type(first) is type(second) and first == second


class _ModuleState:
    """A module's buffers and plain attributes (``vars``: not parameters, buffers or submodules)
    before a trial, for :meth:`restore` to put back."""

    def __init__(self, module: nn.Module) -> None:
        self._buffers = [(buffer, buffer._version, buffer.detach().clone()) for buffer in module.buffers()]
        self._attributes = [(submodule, dict(vars(submodule))) for submodule in module.modules()]

    def restore(self) -> str | None:
        """Put back every buffer and attribute the trial changed; why the module cannot run
        locally, if it changed one. Calling it again changes nothing."""
        reason = None
        with torch.no_grad():
            for index, (buffer, version, saved) in enumerate(self._buffers):
                if buffer._version != version:
                    buffer.copy_(saved)
                    self._buffers[index] = (buffer, buffer._version, saved)
                    reason = reason or "its forward updates a buffer"
        for submodule, saved_vars in self._attributes:
            now = vars(submodule)
            for name in [name for name in now if name not in saved_vars or now[name] is not saved_vars[name]]:
                # State kept on the module between calls (RecurrentGemma's recurrent state): trial
                # runs would leave theirs there.
                reason = reason or f"its forward sets the attribute {type(submodule).__name__}.{name}"
                if name in saved_vars:
                    now[name] = saved_vars[name]
                else:
                    del now[name]
        return reason


class _TrialDepth(threading.local):
    depth = 0


_TRIALS = _TrialDepth()


def trial_running() -> bool:
    """Whether this thread is inside :func:`compare_runs`: the forwards and backwards that run there
    are trials on random stand-ins, and a hook that keeps state across calls must not record them.

    Example::

        def record(module, args, output):
            if not trial_running():
                statistics.append(output)
    """
    return _TRIALS.depth > 0


def compare_runs(
    module: nn.Module,
    leaves: list[Any],
    spec: pytree.TreeSpec,
    slots: list[tuple[nn.Module, str]],
    recording: BoundaryRecording,
) -> str | tuple[tuple[GradientPlacements, ...], dict[SlotKey, GradientPlacements], Any, tuple[Any, ...]]:
    """Run ``module``'s forward both ways on copies of ``leaves`` (see the module docstring).

    Returns what differed, or ``(input gradient placements per leaf, parameter gradient placements
    per slot, output spec, output layouts)``, ``recording`` then holding the conversions. The
    module's buffers and attributes are as before, also when a trial raises."""
    state = _ModuleState(module)
    _TRIALS.depth += 1
    try:
        return _compare(module, leaves, spec, slots, recording, state)
    finally:
        _TRIALS.depth -= 1
        state.restore()


def _compare(
    module: nn.Module,
    leaves: list[Any],
    spec: pytree.TreeSpec,
    slots: list[tuple[nn.Module, str]],
    recording: BoundaryRecording,
    state: _ModuleState,
) -> str | tuple[tuple[GradientPlacements, ...], dict[SlotKey, GradientPlacements], Any, tuple[Any, ...]]:
    forward = type(module).forward
    copies: dict[int, torch.Tensor] = {}
    trial_leaves = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in copies:
                copies[id(leaf)] = _stand_in(leaf, _COTANGENT_SEED + len(copies))
            leaf = copies[id(leaf)]
        trial_leaves.append(leaf)
    stand_ins: dict[int, DTensor] = {}
    parameters: dict[SlotKey, DTensor] = {}
    for owner, name in slots:
        parameter = owner._parameters[name]
        if isinstance(parameter, DTensor):
            if id(parameter) not in stand_ins:
                stand_ins[id(parameter)] = _stand_in(parameter, _PARAMETER_SEED + len(stand_ins))
            if parameter.requires_grad:
                parameters[(id(owner), name)] = stand_ins[id(parameter)]
    inputs = [copy for copy in copies.values() if copy.requires_grad]
    unique_parameters = list({id(parameter): parameter for parameter in parameters.values()}.values())
    targets = inputs + unique_parameters
    mesh_device = next(
        (target.device_mesh.device_type for target in targets if isinstance(target, DTensor)),
        next((leaf.device_mesh.device_type for leaf in leaves if isinstance(leaf, DTensor)), "cpu"),
    )

    with _trial(mesh_device):
        args, kwargs = pytree.tree_unflatten(trial_leaves, spec)
        swapped = SwappedParameters(((owner, name, None) for owner, name in slots), stand_ins, local=False)
        try:
            with running_boundaries(recording):
                dtensor_output = forward(module, *args, **kwargs)
        finally:
            swapped.restore()
    changed = state.restore()
    if changed is not None:
        return changed
    dtensor_leaves, output_spec = pytree.tree_flatten(dtensor_output)
    for leaf in dtensor_leaves:
        if not isinstance(leaf, (torch.Tensor, *SIMPLE_VALUES)):
            return f"its output holds a {type(leaf).__name__}"
    differentiable = [
        index
        for index, leaf in enumerate(dtensor_leaves)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
    cotangents = [_cotangent(dtensor_leaves[index], index) for index in differentiable]
    with _trial(mesh_device):
        dtensor_gradients = _gradients([dtensor_leaves[i] for i in differentiable], targets, cotangents)
    placements_of = {
        id(target): tuple(gradient.placements) if isinstance(gradient, DTensor) else None
        for target, gradient in zip(targets, dtensor_gradients, strict=True)
    }
    input_gradients = tuple(
        placements_of.get(id(copies[id(leaf)])) if isinstance(leaf, DTensor) else None for leaf in leaves
    )
    parameter_gradients = {key: placements_of.get(id(parameter)) for key, parameter in parameters.items()}

    replay = BoundaryReplay(recording.boundaries)
    with _trial(mesh_device):
        local_leaves = [
            leaf.to_local(grad_placements=gradient) if isinstance(leaf, DTensor) else leaf
            for leaf, gradient in zip(trial_leaves, input_gradients, strict=True)
        ]
        args, kwargs = pytree.tree_unflatten(local_leaves, spec)
        swapped = SwappedParameters(
            ((owner, name, parameter_gradients.get((id(owner), name))) for owner, name in slots), stand_ins
        )
        try:
            with running_boundaries(replay), suspended_implicit_replication():
                local_output = forward(module, *args, **kwargs)
        finally:
            swapped.restore()
    replay.finish()
    changed = state.restore()
    if changed is not None:
        return changed
    local_leaves_out, local_spec = pytree.tree_flatten(local_output)
    if local_spec != output_spec:
        return "its local forward returns another structure"
    for index, (expected, got) in enumerate(zip(dtensor_leaves, local_leaves_out, strict=True)):
        if isinstance(got, DTensor) or not _same(
            expected.to_local() if isinstance(expected, DTensor) else expected, got
        ):
            return f"output {index} differs between the DTensor and the local forward"
        if isinstance(expected, torch.Tensor) and expected.requires_grad != got.requires_grad:
            return f"output {index} requires grad in one forward only"
    local_cotangents = [c.to_local() if isinstance(c, DTensor) else c for c in cotangents]
    with _trial(mesh_device):
        local_gradients = _gradients([local_leaves_out[i] for i in differentiable], targets, local_cotangents)
    for index, (expected, got) in enumerate(zip(dtensor_gradients, local_gradients, strict=True)):
        if (expected is None) != (got is None) or (expected is not None and not _same(expected, got)):
            what = "an input" if index < len(inputs) else "a parameter"
            return f"the gradient of {what} differs between the DTensor and the local backward"
    output_layouts = tuple(
        TensorLayout.of(leaf) if isinstance(leaf, DTensor) else None for leaf in dtensor_leaves
    )
    return input_gradients, parameter_gradients, output_spec, output_layouts
