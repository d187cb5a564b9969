"""The check behind local execution: one forward and backward as DTensors, one on local tensors, compared.

:func:`compare_runs` runs a module's forward twice on what :class:`TrialInputs` captured at one
call, under the same random state and with its own saved-tensor hooks (so activation
checkpointing around the module never sees these trial runs). The trials run on stand-ins, not
on the module's values: every floating-point DTensor parameter and input (not Partial) is
replaced by random values in its layout, the same on every rank, so that a value that happens to
be zero now (a freshly initialised bias, which a row-parallel linear would add once per rank on
local tensors) cannot make two different computations agree. So the capture keeps only those
tensors' layouts (:class:`TensorTemplate`), and a trial may run long after the call, when the
call's activations are gone (the layouts of FSDP's unsharded parameters included):

* **as DTensors**, with the plan's conversions inside recorded; a backward from a fixed random
  cotangent per output (Partial outputs get a Replicate one, as ``from_local`` hands them back)
  gives the placements of every input's and parameter's gradient;
* **on local tensors**, the inputs entering through ``to_local`` and the parameters swapped for
  their local shards (:class:`SwappedParameters`), each with the gradient placements just
  recorded, the conversions replayed; the same cotangents, as local tensors.

Outputs and gradients must agree bitwise, in placements and values. The answer is the recorded
layouts, or a sentence saying what differed.

Example::

    trial = TrialInputs.capture(block, leaves, spec)      # at a call: layouts, no activations
    result = compare_runs(block, trial, BoundaryRecording())
    if isinstance(result, str):
        print("stays DTensor:", result)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.utils import _pytree as pytree

from vescale.dmodule._local_boundaries import (
    BoundaryRecording,
    BoundaryReplay,
    TensorLayout,
    running_boundaries,
)
from vescale.dtensor.implicit_replication import (
    implicit_replication_active,
    replicating_plain_tensors,
    suspended_implicit_replication,
)

__all__ = [
    "SIMPLE_VALUES",
    "SwappedParameters",
    "TensorTemplate",
    "TrialInputs",
    "compare_runs",
    "parameter_slots",
    "trial_running",
]

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
        stand_ins: dict[SlotKey, DTensor] | None = None,
        *,
        local: bool = True,
    ) -> None:
        """Without ``stand_ins`` every DTensor parameter is swapped for its local shard. With them
        (by slot: the trial's), exactly their slots are, as DTensors when ``local`` is false (the
        trial's DTensor run), else as their local shards."""
        self._saved: list[tuple[nn.Module, str, Any]] = []
        replacements: dict[int, Any] = {}  # local shards or DTensors, in a Parameter's slot
        try:
            for owner, name, gradient in slots:
                parameter = owner._parameters.get(name)
                source = parameter if stand_ins is None else stand_ins.get((id(owner), name))
                if not isinstance(source, DTensor):
                    continue
                replacement: Any = replacements.get(id(source))  # a tied tensor once
                if replacement is None:
                    replacement = source.to_local(grad_placements=gradient) if local else source
                    replacements[id(source)] = replacement
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


def _randomised(value: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether a trial runs on random values in ``value``'s place: a floating-point DTensor that is
    not Partial (a zero bias would hide a bias counted once per rank)."""
    return (
        isinstance(value, DTensor)
        and value.is_floating_point()
        and not any(placement.is_partial() for placement in value.placements)
    )


@dataclass(frozen=True, eq=False)
class TensorTemplate:
    """The layout of a DTensor that a trial replaces by random values, kept instead of the tensor.

    Example::

        template = TensorTemplate.of(hidden)      # shape, dtype, device, mesh, placements
        stand_in = template.random(seed=7)        # the same values on every rank
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device  # of the local tensor
    requires_grad: bool
    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    @classmethod
    def of(cls, value: DTensor) -> TensorTemplate:
        return cls(
            tuple(value.shape),
            value.dtype,
            value.to_local().device,
            value.requires_grad,
            value.device_mesh,
            tuple(value.placements),
        )

    def random(self, seed: int) -> DTensor:
        """Values drawn from ``seed`` in this layout, the same on every rank (drawn whole, then cut:
        Shard placements need no communication)."""
        generator = torch.Generator().manual_seed(seed)
        full = torch.randn(self.shape, generator=generator).to(dtype=self.dtype, device=self.device)
        whole = DTensor.from_local(full, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        stand_in: DTensor = whole.redistribute(self.mesh, self.placements)
        stand_in.requires_grad_(self.requires_grad)
        return stand_in


@dataclass(frozen=True)
class TrialInputs:
    """What a trial needs from one call of a module, and no more: its argument leaves and their tree
    spec, and its parameter slots; a tensor the trial replaces by random values (see
    :func:`_randomised`) as its :class:`TensorTemplate`, any other value itself. Also whether the
    call ran under implicit replication, which the trial's DTensor forward then runs under too.

    Example::

        trial = TrialInputs.capture(block, leaves, spec)
        trial.local_device()          # where the verdict's agreement runs
    """

    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec
    slots: tuple[tuple[nn.Module, str], ...]
    parameters: tuple[Any, ...]  # per slot
    replicating: bool

    @classmethod
    def capture(cls, module: nn.Module, leaves: list[Any], spec: pytree.TreeSpec) -> TrialInputs:
        kept: dict[int, Any] = {}  # one template per tensor: a tensor passed twice stays one

        def keep(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) not in kept:
                kept[id(value)] = TensorTemplate.of(value) if _randomised(value) else value
            return kept[id(value)]

        slots = parameter_slots(module)
        return cls(
            leaves=tuple(keep(leaf) for leaf in leaves),
            spec=spec,
            slots=tuple(slots),
            parameters=tuple(keep(owner._parameters[name]) for owner, name in slots),
            replicating=implicit_replication_active(),
        )

    def local_device(self) -> torch.device | None:
        """The device of the first DTensor input's local tensor, if there is one."""
        for leaf in self.leaves:
            if isinstance(leaf, TensorTemplate):
                return leaf.device
            if isinstance(leaf, DTensor):
                return leaf.to_local().device
        return None


def _stand_in(value: Any, seed: int) -> Any:
    """What the trial runs on in place of a captured value: random values for a template, a tensor
    itself detached (with its ``requires_grad``), any other value itself."""
    if isinstance(value, TensorTemplate):
        return value.random(seed)
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


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
    module: nn.Module, trial: TrialInputs, recording: BoundaryRecording
) -> str | tuple[tuple[GradientPlacements, ...], dict[SlotKey, GradientPlacements], Any, tuple[Any, ...]]:
    """Run ``module``'s forward both ways on stand-ins for what ``trial`` captured (see the module
    docstring).

    Returns what differed, or ``(input gradient placements per leaf, parameter gradient placements
    per slot, output spec, output layouts)``, ``recording`` then holding the conversions. The
    module's buffers and attributes are as before, also when a trial raises."""
    state = _ModuleState(module)
    _TRIALS.depth += 1
    try:
        return _compare(module, trial, recording, state)
    finally:
        _TRIALS.depth -= 1
        state.restore()


def _compare(
    module: nn.Module, trial: TrialInputs, recording: BoundaryRecording, state: _ModuleState
) -> str | tuple[tuple[GradientPlacements, ...], dict[SlotKey, GradientPlacements], Any, tuple[Any, ...]]:
    forward = type(module).forward
    spec, slots = trial.spec, trial.slots
    made: dict[int, Any] = {}  # stand-ins by id of the captured value: shared values stay shared
    trial_leaves = []
    for leaf in trial.leaves:
        if isinstance(leaf, (torch.Tensor, TensorTemplate)) and id(leaf) not in made:
            made[id(leaf)] = _stand_in(leaf, _COTANGENT_SEED + len(made))
        trial_leaves.append(made.get(id(leaf), leaf))
    stand_ins: dict[SlotKey, DTensor] = {}
    parameters: dict[SlotKey, DTensor] = {}
    for index, ((owner, name), kept) in enumerate(zip(slots, trial.parameters, strict=True)):
        if not isinstance(kept, TensorTemplate):
            if owner._parameters.get(name) is not kept:
                # FSDP's unsharded plain parameter, say: its storage is freed by now.
                return f"its parameter {name!r} was replaced between the call and the trial"
            if not isinstance(kept, DTensor):
                continue  # a plain parameter: both runs use it as it is
        if id(kept) not in made:
            made[id(kept)] = _stand_in(kept, _PARAMETER_SEED + index)
        stand_ins[(id(owner), name)] = made[id(kept)]
        if kept.requires_grad:
            parameters[(id(owner), name)] = made[id(kept)]
    with_gradients = [leaf for leaf in trial_leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    inputs = list({id(leaf): leaf for leaf in with_gradients}.values())
    unique_parameters = list({id(parameter): parameter for parameter in parameters.values()}.values())
    targets = inputs + unique_parameters
    mesh_device = next(
        (target.device_mesh.device_type for target in targets if isinstance(target, DTensor)),
        next((leaf.device_mesh.device_type for leaf in trial_leaves if isinstance(leaf, DTensor)), "cpu"),
    )
    # The call ran under implicit replication (its scope's hooks entered it): so does the trial,
    # which may run outside any forward.
    replicating = (
        replicating_plain_tensors()
        if trial.replicating and not implicit_replication_active()
        else contextlib.nullcontext()
    )

    with _trial(mesh_device):
        args, kwargs = pytree.tree_unflatten(trial_leaves, spec)
        swapped = SwappedParameters(((owner, name, None) for owner, name in slots), stand_ins, local=False)
        try:
            with running_boundaries(recording), replicating:
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
        placements_of.get(id(leaf)) if isinstance(leaf, DTensor) else None for leaf in trial_leaves
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
