"""Treat plain tensors made inside a parallelized module as Replicate, and only there.

A single-device model creates plain tensors in its forward: rotary tables, masks,
position ids, ``torch.arange``/``torch.zeros`` results, buffers. Once the parameters are
DTensors, every op mixing such a tensor with a DTensor fails ("got mixed torch.Tensor and
DTensor"). Inside a parallelized module those tensors hold the same values on every rank,
so treating them as Replicate is correct; outside it (the user's own code) a plain tensor
may be a per-rank shard, so the error stays.

:func:`implicit_replication_scope` does two things during the forward of the module and of
each of its submodules (unless already done by an enclosing one), and undoes them
afterwards, also when the forward raises:

* a ``TorchFunctionMode`` wraps each plain tensor that meets a DTensor in a Python-level
  torch call as a Replicate DTensor *before autograd records the op*, so the backward
  pass, which replays those ops' gradient formulas outside any forward scope, only ever
  sees DTensors (DTensor's own implicit-replication flag cannot reach the backward: the
  autograd engine restores the thread-local state captured when ``backward()`` starts);
* DTensor's implicit-replication flag, for plain tensors that C++ composite ops create
  below the Python level.

Submodules get the scope too because activation checkpointing (``torch.utils.checkpoint``
around a decoder block) recomputes a block's forward during backward, long after the
module's own forward has exited and under the thread state of ``backward()``: the block's
submodules (its attention, its MLP) then enter the scope themselves, so a rotary table
saved as a plain tensor is Replicate in the recomputation as it was in the forward.

A custom ``torch.autograd.Function`` in model code runs its ``backward`` outside every module
(Reformer sorts its attention by bucket in one, keeping the plain sort indices on ``ctx``): once
a scope exists, such a backward that receives DTensor gradients runs under the same mode, so
the indices are Replicate there as they were in its forward. torch's own Functions (DTensor's,
FSDP's, checkpointing's), and subclasses that keep
their backward, are left as they are.

Example::

    handle = implicit_replication_scope(model)
    loss = model(input_ids, labels=labels).loss   # rotary tables become Replicate DTensors
    loss.backward()
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

from vescale.dtensor import _compat
from vescale.dtensor.errors import DTensorError
from vescale.dtensor.ops.attention import expand_unpaired_key_value_heads
from vescale.dtensor.replicated_reads import read_replicated_values

__all__ = [
    "ImplicitReplicationError",
    "ImplicitReplicationHandle",
    "ReplicatePlainTensorsMode",
    "implicit_replication_active",
    "implicit_replication_scope",
    "replicating_plain_tensors",
    "suspended_implicit_replication",
]

# Per thread: how many suspended_implicit_replication() blocks are open.
_SUSPENSION = threading.local()


class ImplicitReplicationError(DTensorError, TypeError):
    """:func:`implicit_replication_scope` was given something that is not an ``nn.Module``."""


def _first_dtensor(value: Any) -> DTensor | None:
    if isinstance(value, DTensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_dtensor(item)
            if found is not None:
                return found
    elif isinstance(value, dict):
        return _first_dtensor(list(value.values()))
    return None


def _scan(value: Any, found: list[Any]) -> None:
    """Note in ``found`` (``[first DTensor or None, whether a plain tensor of rank >= 1 was seen]``)
    what ``value`` holds, through lists, tuples and dicts, in one pass."""
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):
            if found[0] is None:
                found[0] = value
        elif value.ndim:
            found[1] = True
    elif isinstance(value, (list, tuple)):
        for item in value:
            _scan(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _scan(item, found)


def _replicate_plain(value: Any, exemplar: DTensor) -> Any:
    if isinstance(value, DTensor):
        return value
    if isinstance(value, torch.Tensor):
        # Scalars already count as replicated in DTensor; leave them cheap.
        if value.ndim == 0:
            return value
        mesh = exemplar.device_mesh
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
        return type(value)(_replicate_plain(item, exemplar) for item in value)
    if isinstance(value, dict):
        return {key: _replicate_plain(item, exemplar) for key, item in value.items()}
    return value


class ReplicatePlainTensorsMode(TorchFunctionMode):
    """While active, a torch call that mixes plain tensors with DTensors sees the plain ones
    as Replicate DTensors on the first DTensor's mesh.

    Example::

        with ReplicatePlainTensorsMode():
            rotated = sharded_query * torch.ones(sharded_query.shape)
        assert rotated.placements == sharded_query.placements
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # One pass over the arguments; most calls hold only DTensors and scalars, and are passed
        # on without rebuilding their argument tuples.
        found: list[Any] = [None, False]
        _scan(args, found)
        if kwargs:
            _scan(kwargs, found)
        exemplar, mixed = found
        if exemplar is not None:
            if mixed:
                args = _replicate_plain(args, exemplar)
                kwargs = _replicate_plain(kwargs, exemplar)
            if func is torch.nn.functional.scaled_dot_product_attention:
                args, kwargs = expand_unpaired_key_value_heads(args, kwargs)
            handled, value = read_replicated_values(func, args, kwargs)
            if handled:
                return value
        return func(*args, **kwargs)


class ImplicitReplicationHandle:
    """The hooks of one :func:`implicit_replication_scope`; ``remove()`` takes them off.

    Example::

        handle = implicit_replication_scope(model)
        handle.remove()   # model's forward may mix plain tensors and DTensors no more
    """

    def __init__(self, module: nn.Module) -> None:
        # One entry per forward still running (modules nest and may be re-entered): the module and
        # the scope its forward entered, or None where an enclosing one had.
        self._active: list[tuple[nn.Module, contextlib.ExitStack | None]] = []
        self._hook_handles: dict[nn.Module, list[Any]] = {
            submodule: [
                submodule.register_forward_pre_hook(self._enter_forward),
                submodule.register_forward_hook(self._exit_forward, always_call=True),
            ]
            for submodule in module.modules()
        }

    def remove(self) -> None:
        """Remove the hooks; later forwards of the module run without the scope."""
        for handles in self._hook_handles.values():
            for hook_handle in handles:
                hook_handle.remove()
        self._hook_handles = {}

    def remove_inside(self, module: nn.Module) -> None:
        """Remove the hooks of ``module``'s submodules (not its own): for a block ``torch.compile``
        traces, which the scope entered by ``module`` or an enclosing module covers whole.

        Inside traced code the hooks do nothing, but dynamo guards on each always-called hook's
        id, which differs between blocks, so that every block would compile on its own.

        Example::

            handle.remove_inside(model.layers[0])   # before torch.compile(model.layers[0].forward)
        """
        for submodule in module.modules():
            if submodule is not module:
                for hook_handle in self._hook_handles.pop(submodule, []):
                    hook_handle.remove()

    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        # Under torch.compile (a compiled block inside the model), the enclosing module's forward
        # entered the scope before the compiled region and dynamo traces through the active mode;
        # entering a mode or reading the mode stack inside the traced region would break the graph.
        if torch.compiler.is_compiling() or _suspension_depth():
            self._active.append((module, None))
            return
        # The thread's mode stack, not self._active, says whether a scope is on: in backward the
        # autograd engine has reset the stack while this module's forward may still be running.
        if _in_replication_mode():
            self._active.append((module, None))
            return
        scope = contextlib.ExitStack()
        scope.enter_context(_replicating())
        self._active.append((module, scope))

    def _exit_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # torch calls this always-called hook also when an earlier pre-hook of the module raised,
        # before _enter_forward ran: then the top entry is an enclosing module's, and stays.
        if not self._active or self._active[-1][0] is not module:
            return
        _, scope = self._active.pop()
        if scope is not None:
            scope.close()


def _in_replication_mode() -> bool:
    return any(isinstance(mode, ReplicatePlainTensorsMode) for mode in _compat.active_torch_function_modes())


def implicit_replication_active() -> bool:
    """Whether this thread runs inside a scope's forward (the mode is on its stack).

    Example::

        if implicit_replication_active():
            ...   # a plain tensor meeting a DTensor here is Replicate
    """
    return _in_replication_mode()


@contextlib.contextmanager
def replicating_plain_tensors() -> Iterator[None]:
    """Inside, plain tensors meet DTensors as Replicate, as in a scope's forward: for code that runs
    a module's forward outside its call (a trial run of :mod:`vescale.dmodule.local_execution`).

    Example::

        with replicating_plain_tensors():
            output = type(block).forward(block, hidden)   # as inside block(hidden)
    """
    with _replicating():
        yield


@contextlib.contextmanager
def _replicating() -> Iterator[None]:
    """Inside, plain tensors meet DTensors as Replicate: veScale's mode and DTensor's own flag."""
    saved_setting = _compat.dtensor_implicit_replication_enabled()
    _compat.set_dtensor_implicit_replication(True)
    try:
        with ReplicatePlainTensorsMode():
            yield
    finally:
        _compat.set_dtensor_implicit_replication(saved_setting)


def _suspension_depth() -> int:
    depth: int = getattr(_SUSPENSION, "depth", 0)
    return depth


@contextlib.contextmanager
def suspended_implicit_replication() -> Iterator[None]:
    """Inside, plain tensors are not made Replicate, and submodule forwards do not enter the scope.

    For code that runs a parallelized module on local tensors only (every value plain, placements
    tracked by the caller): the mode is taken off when it is the innermost torch-function mode
    (sparing each torch call a Python dispatch), DTensor's own flag is off, and the scope's module
    hooks leave both so until the block ends.

    Example::

        with suspended_implicit_replication():
            local_output = block.forward(local_hidden)     # plain tensors throughout
    """
    depth = _suspension_depth()
    _SUSPENSION.depth = depth + 1
    modes = _compat.active_torch_function_modes()
    popped = (
        _compat.pop_torch_function_mode()
        if modes and isinstance(modes[-1], ReplicatePlainTensorsMode)
        else None
    )
    saved_setting = _compat.dtensor_implicit_replication_enabled()
    _compat.set_dtensor_implicit_replication(False)
    try:
        yield
    finally:
        _compat.set_dtensor_implicit_replication(saved_setting)
        if popped is not None:
            _compat.push_torch_function_mode(popped)
        _SUSPENSION.depth = depth


def _backward_module(function_class: Any) -> str:
    """The module that defines ``function_class``'s ``backward``: torch's own for a subclass of a
    torch Function that keeps its backward (doptim's FSDP2 post-backward Function), whose code
    then runs without the mode (each of its tensor calls would pass through it)."""
    for cls in getattr(function_class, "__mro__", ()):
        if "backward" in cls.__dict__:
            return getattr(cls, "__module__", "") or ""
    return ""


def _install_custom_backward_scope() -> None:
    """Run model code's custom autograd Functions' backward with DTensor gradients in the mode
    (idempotent, process-wide; see the module docstring)."""
    node_class = _compat.custom_function_backward_class()
    original = node_class.__dict__["apply"]
    if getattr(original, "vescale_replicates_plain_tensors", False):
        return

    def apply(node: Any, *grads: Any) -> Any:
        backward_module = _backward_module(getattr(node, "_forward_cls", None))
        if backward_module.startswith("torch.") or _first_dtensor(grads) is None or _in_replication_mode():
            return original(node, *grads)
        with _replicating():
            return original(node, *grads)

    apply.vescale_replicates_plain_tensors = True  # type: ignore[attr-defined]
    node_class.apply = apply  # type: ignore[attr-defined]


def implicit_replication_scope(module: nn.Module) -> ImplicitReplicationHandle:
    """Treat plain tensors as Replicate DTensors inside the forward of ``module`` and its submodules
    (and so in their backward, and in their recomputation by activation checkpointing).

    Outside the module, mixing a plain tensor with a DTensor still raises. The dmodule
    package calls this on every module it parallelizes.

    Example::

        handle = implicit_replication_scope(model)
        model(input_ids).logits.sum().backward()
        handle.remove()
    """
    if not isinstance(module, nn.Module):
        raise ImplicitReplicationError(
            f"implicit_replication_scope expects an nn.Module, got {type(module).__name__}; "
            "pass the parallelized module whose forward creates plain tensors."
        )
    _install_custom_backward_scope()
    return ImplicitReplicationHandle(module)
