"""Run a parallelized module's forward on local tensors once that is verified to change nothing.

Every op on a DTensor pays for sharding propagation and a wrapper (12 µs for a ``mul`` that costs
3.5 µs on the plain tensor, 26 µs for a ``view`` that costs 0.8). Inside a decoder block most ops
only reshape, rotate and mix a rank's own heads or columns: the local tensors alone would compute
the same. This module runs such a module's forward on local tensors, as hand-written tensor
parallelism does, but only where a check proves it equivalent, for each input signature (shapes,
dtypes, placements, ``requires_grad``, non-tensor arguments, training mode):

1. the first call with a signature runs as DTensors and keeps what a trial needs: the layouts of
   its floating-point DTensor inputs and parameters, its other arguments (:class:`TrialInputs`).
   The trial runs before the parallelized root module's next forward (:func:`run_pending_trials`,
   once the step's activations are freed, so that it never adds to the step's peak memory), or at
   the module's next call with that signature if the root's forward comes first. It runs the
   forward twice, with the same random state, on random stand-ins for those inputs and parameters
   (so that a value that happens to be zero, a fresh bias, cannot make two computations agree):
   as DTensors (recording the plan's conversions inside it and, through a backward with a fixed
   random cotangent, the placements of every gradient), then on local tensors with the
   parameters swapped for their local shards and the conversions replayed
   (:mod:`vescale.dmodule._local_boundaries`);
2. the outputs, and the gradients of the inputs and parameters, must agree **bitwise**, in
   placements and values; the tensor-parallel ranks agree on the verdict (one all-reduce);
3. calls with a verified signature then run locally: each DTensor input and parameter enters
   through ``to_local`` with its recorded gradient placements (a Replicate ``q_norm`` weight whose
   gradient is Partial stays Partial, for the module's gradient sync to reduce), the outputs leave
   through ``from_local`` with their recorded layouts. Anything else runs as before.

A module is not tried when its subtree holds an expert-parallel module (its all-to-all sends
data-dependent counts), an FSDP unit below itself, a sharded embedding (a lookup of global
indices), or a forward or backward hook of the user's on a module below it (which would see
local shards where it saw DTensors; its own hooks run around the call and see DTensors), nor
when an input is an object its forward may change (a key/value cache: training passes
``use_cache=False``) or its forward updates a buffer (BatchNorm's running statistics) or sets
an attribute (a recurrent state; the trial's is put back). A forward that raises or differs
in the trial, or takes another path in a later call (:class:`LocalReplayDiverged`: the same
conversions must come in the same order), runs as DTensors from then on for that signature. A
module verifies at most ``MAX_SIGNATURES`` (16) signatures: shapes that change every step pay a
trial only in the first steps. No trial runs without gradients, inside a backward (a custom
Function recomputing its forward there) or under a dispatch mode (fake tensors, selective
activation checkpointing's op cache); under ``torch.compile`` the forward runs as DTensors (the
compiler removes the per-op cost itself). Which modules run locally, and why the others do not, is
in :func:`local_execution_report`. Trials run the forwards of the modules inside, hooks included:
a veScale hook that keeps state across calls (the pipeline's router statistics) skips them
(:func:`trial_running`).

Example::

    parallelize_module(model, mesh, plan)                 # local_execution=True by default
    model(input_ids).logits.sum().backward()              # DTensors; each block's trial is noted
    model(input_ids).logits.sum().backward()              # trials first, then the blocks run locally
    print(local_execution_report(model))                  # {'model.layers.0': ['local'], ...}
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from vescale.dmodule._local_boundaries import (
    Boundary,
    BoundaryRecording,
    BoundaryReplay,
    LocalReplayDiverged,
    TensorLayout,
    current_boundaries,
    running_boundaries,
)
from vescale.dmodule._local_verification import (
    SIMPLE_VALUES,
    SwappedParameters,
    TrialInputs,
    compare_runs,
    trial_running,
)
from vescale.dtensor import _compat
from vescale.dtensor.implicit_replication import suspended_implicit_replication

__all__ = [
    "LocalExecution",
    "install_local_execution",
    "keep_ancestors_on_dtensors",
    "local_execution_report",
    "run_pending_trials",
    "trial_running",
]

LOCAL_EXECUTION_ATTRIBUTE = "_vescale_local_execution"
# Why no module holding this one may run on local tensors (see keep_ancestors_on_dtensors).
KEEP_ANCESTORS_ATTRIBUTE = "_vescale_keep_ancestors_on_dtensors"
# Input signatures a module verifies; calls with further new ones run as DTensors unverified.
MAX_SIGNATURES = 16
PENDING = "DTensor: its trial runs before the next forward"


@dataclass(frozen=True)
class LocalPlan:
    """What a verified signature's local forward needs: the recorded layouts and gradient placements."""

    input_gradients: tuple[tuple[Any, ...] | None, ...]  # per input leaf; None for non-DTensors
    parameter_gradients: tuple[tuple[nn.Module, str, tuple[Any, ...] | None], ...]
    boundaries: tuple[Boundary, ...]
    output_spec: pytree.TreeSpec
    output_layouts: tuple[TensorLayout | None, ...]


@dataclass(frozen=True)
class Rejected:
    """Why a signature runs as DTensors."""

    reason: str


def _signature(module: nn.Module, leaves: list[Any], spec: pytree.TreeSpec) -> tuple[Any, ...]:
    parts: list[Any] = [spec, module.training]
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            parts.append((leaf.shape, leaf.dtype, leaf.requires_grad, tuple(leaf.placements)))
        elif isinstance(leaf, torch.Tensor):
            parts.append((leaf.shape, leaf.dtype, leaf.requires_grad))
        elif isinstance(leaf, SIMPLE_VALUES):
            parts.append(leaf)
        else:
            parts.append(type(leaf))
    return tuple(parts)


class LocalExecution:
    """The local-execution state of one module: its verdict per input signature.

    Example::

        execution = getattr(block, LOCAL_EXECUTION_ATTRIBUTE)
        execution.verdicts()        # {signature: LocalPlan | Rejected}
    """

    def __init__(self, mesh: DeviceMesh, mesh_dim: int) -> None:
        self.mesh = mesh
        self.mesh_dim = mesh_dim
        self.enabled = True
        self._verdicts: dict[tuple[Any, ...], LocalPlan | Rejected] = {}
        # Signatures seen once, with what their trial needs (run by run_pending or the next call).
        self._pending: dict[tuple[Any, ...], TrialInputs] = {}
        self._hook_count = -1  # the hooks in the subtree when the verdicts were made
        self._subtree: list[nn.Module] | None = None

    def verdicts(self) -> dict[tuple[Any, ...], LocalPlan | Rejected]:
        return dict(self._verdicts)

    def pending(self) -> list[tuple[Any, ...]]:
        """The signatures whose trial has not run yet."""
        return list(self._pending)

    def _check_hooks(self, module: nn.Module) -> None:
        if self._subtree is None:
            self._subtree = list(module.modules())
        hook_count = (
            sum(map(_compat.module_call_hook_count, self._subtree)) + _compat.global_call_hook_count()
        )
        if hook_count != self._hook_count:
            # A hook came or went since the verdicts (a user's hook must see DTensors): start over.
            self._verdicts.clear()
            self._pending.clear()
            self._hook_count = hook_count

    def call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        forward = type(module).forward
        if not self.enabled or current_boundaries() is not None:
            return forward(module, *args, **kwargs)  # inside an enclosing verification or local forward
        self._check_hooks(module)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = _signature(module, leaves, spec)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if not _may_try():
                return forward(module, *args, **kwargs)
            trial = self._pending.pop(key, None)
            if trial is None:
                if len(self._verdicts) + len(self._pending) >= MAX_SIGNATURES:
                    # Shapes that change every step (unpadded batches) would pay a trial every step.
                    return forward(module, *args, **kwargs)
                static = _static_rejection(module, leaves)
                if static is not None:
                    self._verdicts[key] = static  # the same on every rank: no agreement needed
                else:
                    # This call runs as DTensors; the trial waits for a point with less memory alive.
                    self._pending[key] = TrialInputs.capture(module, leaves, spec)
                return forward(module, *args, **kwargs)
            # The root's forward did not come first (the module called on its own): try it now.
            verdict = self._verify(module, trial)
            self._verdicts[key] = verdict
        if isinstance(verdict, Rejected):
            return forward(module, *args, **kwargs)
        try:
            return self._run_local(module, verdict, leaves, spec)
        except LocalReplayDiverged as diverged:
            # Every tensor-parallel rank holds the same inputs and takes the same path: all of them
            # end up here at the same conversion, and run the forward again as DTensors.
            self._verdicts[key] = Rejected(f"a later call took another path: {diverged}")
            return forward(module, *args, **kwargs)

    def _run_local(self, module: nn.Module, plan: LocalPlan, leaves: list[Any], spec: pytree.TreeSpec) -> Any:
        local_leaves = [
            leaf.to_local(grad_placements=gradient) if isinstance(leaf, DTensor) else leaf
            for leaf, gradient in zip(leaves, plan.input_gradients, strict=True)
        ]
        args, kwargs = pytree.tree_unflatten(local_leaves, spec)
        replay = BoundaryReplay(list(plan.boundaries))
        swapped = SwappedParameters(plan.parameter_gradients)
        try:
            with running_boundaries(replay), suspended_implicit_replication():
                output = type(module).forward(module, *args, **kwargs)
        finally:
            swapped.restore()
        replay.finish()
        output_leaves, output_spec = pytree.tree_flatten(output)
        if output_spec != plan.output_spec:
            raise LocalReplayDiverged("the forward returned another structure than the verified one")
        wrapped = []
        for leaf, layout in zip(output_leaves, plan.output_layouts, strict=True):
            if layout is not None:
                if not isinstance(leaf, torch.Tensor) or isinstance(leaf, DTensor):
                    raise LocalReplayDiverged("an output that was a DTensor is not a local tensor")
                leaf = layout.wrap(leaf)
            wrapped.append(leaf)
        return pytree.tree_unflatten(wrapped, output_spec)

    def discard_pending(self) -> None:
        """Forget the signatures seen once: a later call notes them again."""
        self._pending.clear()

    def run_pending(self, module: nn.Module) -> None:
        """Run the trials of the signatures seen once, in the order they were seen; those noted in
        another training mode than the module's now wait (a trial runs the forward as it is now)."""
        self._check_hooks(module)
        for key in [key for key in self._pending if key[1] == module.training]:
            self._verdicts[key] = self._verify(module, self._pending.pop(key))

    def _verify(self, module: nn.Module, trial: TrialInputs) -> LocalPlan | Rejected:
        try:
            verdict = self._compare(module, trial)
        except LocalReplayDiverged as diverged:
            verdict = Rejected(str(diverged))
        except Exception as error:  # any failure of a trial run means: keep DTensors
            verdict = Rejected(f"{type(error).__name__}: {error}")
        verified = isinstance(verdict, LocalPlan)
        if not self._ranks_agree(verified, trial.local_device()) and verified:
            verdict = Rejected("another tensor-parallel rank's local run differed")
        return verdict

    def _compare(self, module: nn.Module, trial: TrialInputs) -> LocalPlan | Rejected:
        recording = BoundaryRecording()
        result = compare_runs(module, trial, recording)
        if isinstance(result, str):
            return Rejected(result)
        input_gradients, parameter_gradients, output_spec, output_layouts = result
        return LocalPlan(
            input_gradients=input_gradients,
            parameter_gradients=tuple(
                (owner, name, parameter_gradients.get((id(owner), name))) for owner, name in trial.slots
            ),
            boundaries=tuple(recording.boundaries),
            output_spec=output_spec,
            output_layouts=output_layouts,
        )

    def _ranks_agree(self, verified: bool, device: torch.device | None) -> bool:
        if self.mesh.size(self.mesh_dim) == 1:
            return verified
        if device is None:
            on_cpu = self.mesh.device_type == "cpu"
            device = torch.device("cpu") if on_cpu else torch.device(self.mesh.device_type, 0)
        flag = torch.tensor([1 if verified else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.mesh.get_group(self.mesh_dim))
        return bool(flag.item())


def _may_try() -> bool:
    """Whether a trial may run here: with gradients available (a trial turns them on itself, but
    a signature first seen without them, in evaluation, is left alone); not under a dispatch mode
    (fake tensors; selective checkpointing's op cache, which trial runs would fill with ops its
    recomputation does not replay); not inside a backward (a custom Function that recomputes its
    forward there, as Reformer's reversible layers do)."""
    return (
        torch.is_grad_enabled()
        and not _compat.dispatch_mode_active()
        and _compat.current_autograd_node() is None
    )


def run_pending_trials(root: nn.Module, modules: list[nn.Module]) -> None:
    """Run the trials that ``modules`` (from :func:`install_local_execution` on ``root``) noted at
    their first calls: ``parallelize_module`` calls it before each forward of ``root``, where the
    previous step's activations are freed. Every tensor-parallel rank runs the same trials in the
    same order (each ends in one all-reduce of the verdict).

    A module inside an FSDP unit (ZeRO-3) is tried with the unit's parameters gathered, as at its
    call (``FSDPModule.unshard``, resharded afterwards if they were sharded): the trial's
    stand-ins take the unsharded parameters' layout, and an inner module called outside its unit's
    forward would otherwise gather the unit under the trial (vescale.doptim's reentry hooks).

    Example::

        run_pending_trials(model, getattr(model, DMODULE_ATTRIBUTE).local_execution)
    """
    if torch.compiler.is_compiling() or current_boundaries() is not None or torch.is_inference_mode_enabled():
        return  # under inference mode no trial could take a gradient
    if _compat.dispatch_mode_active() or _compat.current_autograd_node() is not None:
        return
    waiting = [
        module
        for module in modules
        if (execution := module.__dict__.get(LOCAL_EXECUTION_ATTRIBUTE)) is not None
        and execution.enabled
        and execution.pending()
    ]
    if not waiting:
        return
    units = _enclosing_fsdp_units(root)
    # Modules inside one that now runs locally are called within its local forward only, where
    # they run as they are: their trials would be spent (parents come first in `modules`).
    covered: set[nn.Module] = set()
    for unit, group in itertools.groupby(waiting, key=lambda module: units.get(module)):
        with _gathered(unit):
            for module in group:
                execution = module.__dict__[LOCAL_EXECUTION_ATTRIBUTE]
                if module in covered:
                    execution.discard_pending()
                    continue
                execution.run_pending(module)
                verdicts = execution.verdicts().values()
                if verdicts and not execution.pending() and all(isinstance(v, LocalPlan) for v in verdicts):
                    covered.update(module.modules())


def _enclosing_fsdp_units(root: nn.Module) -> dict[nn.Module, FSDPModule]:
    """Each module below ``root`` (and ``root``) mapped to the innermost FSDP unit holding it."""
    units: dict[nn.Module, FSDPModule] = {}

    def visit(module: nn.Module, unit: FSDPModule | None) -> None:
        unit = module if isinstance(module, FSDPModule) else unit
        if unit is not None:
            units[module] = unit
        for child in module.children():
            visit(child, unit)

    visit(root, None)
    return units


@contextlib.contextmanager
def _gathered(unit: FSDPModule | None) -> Iterator[None]:
    if unit is None:
        yield
        return
    module = cast(nn.Module, unit)  # fully_shard's dynamic subclass of the module's own class
    before = list(module.parameters())
    unit.unshard()
    # FSDP2 registers the unsharded parameters in place of the shards: a change says they were sharded.
    was_sharded = any(old is not new for old, new in zip(before, module.parameters(), strict=True))
    try:
        yield
    finally:
        if was_sharded:
            unit.reshard()


def keep_ancestors_on_dtensors(module: nn.Module, reason: str) -> None:
    """Never run a module that holds ``module`` on local tensors, nor try it, for ``reason``.

    For veScale's own hooks whose effect is not a function of the call (a pipeline stage's
    boundary swaps the received hidden state in and sets the generator where one device's
    forward of that stage begins): a trial of an ancestor would run them, out of turn.

    Example::

        keep_ancestors_on_dtensors(model.layers[4], "a pipeline stage boundary")
    """
    setattr(module, KEEP_ANCESTORS_ATTRIBUTE, reason)


def _static_rejection(module: nn.Module, leaves: list[Any]) -> Rejected | None:
    """A reason known without running the forward, the same on every rank."""
    from vescale.dmodule.experts.parallelize import EXPERT_PARALLEL_ATTRIBUTE

    for fqn, submodule in module.named_modules():
        where = fqn or "<self>"
        # The module's own hooks run around its call, outside the local forward: they see the
        # DTensors it takes and gives back (and their gradients), as without local execution.
        hooks = _compat.module_call_hooks(submodule) if fqn else []
        foreign = next((hook for hook in hooks if _is_foreign(hook)), None)
        kept_by = getattr(submodule, KEEP_ANCESTORS_ATTRIBUTE, None) if fqn else None
        if kept_by is not None:
            return Rejected(f"holds {where!r}, {kept_by}")
        if foreign is not None:
            # It would see local shards where it saw DTensors (an activation statistic would then
            # be one rank's part): the module keeps DTensors while such a hook is on.
            return Rejected(f"{where!r} has the hook {_hook_name(foreign)}, which expects DTensors")
        if getattr(submodule, EXPERT_PARALLEL_ATTRIBUTE, None) is not None:
            return Rejected(
                f"holds the expert-parallel module {where!r} (an all-to-all of data-dependent sizes)"
            )
        if fqn and isinstance(submodule, FSDPModule):
            # A trial forward would run its unshard and reshard hooks, and its backward the
            # gradient reduction's.
            return Rejected(f"holds the FSDP unit {fqn!r}")
        weight = getattr(submodule, "weight", None)
        if (
            isinstance(submodule, nn.Embedding)
            and isinstance(weight, DTensor)
            and any(placement.is_shard() for placement in weight.placements)
        ):
            return Rejected(f"holds the sharded embedding {where!r} (a lookup of global indices)")
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *SIMPLE_VALUES)):
            # A cache or other object the forward may change: trial runs would change it too.
            return Rejected(
                f"takes a {type(leaf).__name__} argument (e.g. a key/value cache: use_cache=False)"
            )
    if not any(isinstance(leaf, DTensor) for leaf in leaves) and not any(
        isinstance(parameter, DTensor) for parameter in module.parameters()
    ):
        return Rejected("no DTensor among its inputs and parameters")
    return None


def _hook_function(hook: Any) -> Any:
    hook = getattr(hook, "func", hook)  # functools.partial
    return getattr(hook, "__func__", hook)  # bound method


def _is_foreign(hook: Any) -> bool:
    """A hook neither veScale's (placements, implicit replication, error notes) nor torch's (FSDP)."""
    defined_in = getattr(_hook_function(hook), "__module__", None) or ""
    return not defined_in.startswith(("vescale.", "torch."))


def _hook_name(hook: Any) -> str:
    function = _hook_function(hook)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def _local_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_compiling():
        return type(self).forward(self, *args, **kwargs)
    execution: LocalExecution = getattr(self, LOCAL_EXECUTION_ATTRIBUTE)
    return execution.call(self, args, kwargs)


def _is_candidate(module: nn.Module) -> bool:
    # torch.nn's own modules are single ops (Linear, Embedding, Dropout) or containers: running
    # one locally would add more wrapping than it removes.
    if type(module).__module__.startswith("torch."):
        return False
    return any(True for _ in module.parameters())


def install_local_execution(root: nn.Module, mesh: DeviceMesh, mesh_dim: int) -> list[nn.Module]:
    """Give every candidate submodule of ``root`` (not ``root`` itself) local execution; return them.

    A candidate is a module defined outside ``torch`` that holds parameters. Its ``forward``
    becomes an instance attribute that consults its :class:`LocalExecution` (``type(m).forward``
    stays the model's own). :func:`remove_local_execution` undoes it.

    Example::

        modules = install_local_execution(model, mesh, mesh_dim=1)
    """
    installed = []
    for fqn, module in root.named_modules():
        if not fqn or not _is_candidate(module) or LOCAL_EXECUTION_ATTRIBUTE in module.__dict__:
            continue
        setattr(module, LOCAL_EXECUTION_ATTRIBUTE, LocalExecution(mesh, mesh_dim))
        module.forward = _forward_of(module)
        installed.append(module)
    return installed


def _forward_of(module: nn.Module) -> types.MethodType:
    """``_local_forward`` bound to ``module``, under the name, docstring and signature of its own
    forward: ``inspect.signature(module.forward)`` must still name the model's parameters (the plan's
    keyword inputs are found through it, and so does transformers' own code)."""
    original = type(module).forward
    function = types.FunctionType(_local_forward.__code__, _local_forward.__globals__, original.__name__)
    functools.update_wrapper(function, original)
    return types.MethodType(function, module)


def remove_local_execution(modules: list[nn.Module]) -> None:
    """Undo :func:`install_local_execution` on ``modules``."""
    for module in modules:
        module.__dict__.pop("forward", None)
        module.__dict__.pop(LOCAL_EXECUTION_ATTRIBUTE, None)


def local_execution_report(root: nn.Module) -> dict[str, list[str]]:
    """Per module with local execution: one line per input signature seen, ``'local'`` or why not.

    Example::

        for fqn, verdicts in local_execution_report(model).items():
            print(fqn, verdicts)          # model.layers.0 ['local']
    """
    report = {}
    for fqn, module in root.named_modules():
        execution = module.__dict__.get(LOCAL_EXECUTION_ATTRIBUTE)
        if execution is None:
            continue
        report[fqn] = [
            "local" if isinstance(verdict, LocalPlan) else f"DTensor: {verdict.reason}"
            for verdict in execution.verdicts().values()
        ] + [PENDING] * len(execution.pending())
    return report
