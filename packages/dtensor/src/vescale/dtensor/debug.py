"""Log every DTensor op with its input and output placements and the module that ran it.

:class:`DTensorOpLogger` is a dispatch mode: it sees each aten op that has a DTensor
argument (after autograd, so ``F.linear`` shows as ``aten.t`` + ``aten.addmm``), runs it,
and records the placements going in and coming out in their short form (``"S(0)"``,
``"R"``, ``"P"``, ``"IS(0,3)"``) through ``logging.getLogger("vescale.dtensor")``.

The module FQN comes from forward pre/post hooks on the model's modules. In backward, an
op is attributed to the module whose forward created the autograd node now running: each
module's forward hook tags the autograd nodes its outputs were made by (walking the graph
back until nodes already tagged, so each node is visited once) in ``node.metadata``; the
inputs' nodes are tagged with the enclosing module first, so they are not taken for the
module's own. Ops outside any tagged node (e.g. the loss, computed outside the model) get
the FQN ``""``, as does the model's own root.

Example::

    with log_dtensor_ops(model) as op_logger:
        model(batch).sum().backward()
    print(op_logger.records[0])   # DTensorOpRecord(op='aten.t.default', module_fqn='fc1', ...)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.distributed.tensor import DTensor

from vescale.dtensor import _compat
from vescale.dtensor._comm_records import BACKWARD, FORWARD
from vescale.dtensor.placements import PlacementError, placement_to_string

__all__ = ["DTensorOpLogger", "DTensorOpRecord", "log_dtensor_ops"]

LOGGER = logging.getLogger("vescale.dtensor")
# The key under which a module's FQN is stored in an autograd node's metadata dict.
MODULE_FQN_METADATA_KEY = "vescale_module_fqn"


@dataclass(frozen=True)
class DTensorOpRecord:
    """One DTensor op: its name, owning module, phase, and the placements of each DTensor in and out."""

    op: str
    module_fqn: str
    phase: str
    input_placements: tuple[tuple[str, ...], ...]
    output_placements: tuple[tuple[str, ...], ...]

    def __str__(self) -> str:
        inputs = " ".join(f"[{','.join(p)}]" for p in self.input_placements)
        outputs = " ".join(f"[{','.join(p)}]" for p in self.output_placements)
        return f"{self.phase} {self.module_fqn or '<root>'} {self.op}: {inputs} -> {outputs}"


def _short(placement: Any) -> str:
    try:
        return placement_to_string(placement)
    except PlacementError:
        return repr(placement)  # a placement with no plan form (e.g. a norm Partial) is still worth seeing


def _dtensor_placements(value: Any) -> list[tuple[str, ...]]:
    """The short placements of every DTensor in an op's arguments or results, in order."""
    if isinstance(value, DTensor):
        return [tuple(_short(placement) for placement in value.placements)]
    if isinstance(value, (list, tuple)):
        return [placements for item in value for placements in _dtensor_placements(item)]
    if isinstance(value, dict):
        return [placements for item in value.values() for placements in _dtensor_placements(item)]
    return []


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


def _tag_autograd_nodes(value: Any, module_fqn: str) -> None:
    """Tag the untagged autograd nodes that made ``value``'s tensors with ``module_fqn``."""
    pending: list[Node | None] = [tensor.grad_fn for tensor in _tensors(value) if tensor.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node is None:
            continue
        # A dict attribute at run time; torch's stubs declare a method.
        metadata = cast(dict[str, Any], node.metadata)
        if MODULE_FQN_METADATA_KEY in metadata:
            continue
        metadata[MODULE_FQN_METADATA_KEY] = module_fqn
        pending.extend(next_node for next_node, _ in node.next_functions)


if TYPE_CHECKING:
    from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
else:
    _DispatchModeBase = _compat.torch_dispatch_mode_class()


class DTensorOpLogger(_DispatchModeBase):
    """Record (and log) each DTensor op's placements with the FQN of the module running it.

    Enter it inside a :class:`vescale.dtensor.comm.CommCounter`, not outside, so that the
    counter still sees the collectives of the ops this mode runs.

    Example::

        with DTensorOpLogger(model, level=logging.INFO) as op_logger:
            loss = model(batch).sum(); loss.backward()
        [str(record) for record in op_logger.records]
    """

    def __init__(self, model: nn.Module | None = None, *, level: int = logging.DEBUG) -> None:
        super().__init__()
        self.model = model
        self.level = level
        self.records: list[DTensorOpRecord] = []
        self._module_stack: list[str] = []
        self._hook_handles: list[Any] = []

    def __enter__(self) -> DTensorOpLogger:
        self.records = []
        self._module_stack = []
        if self.model is not None:
            for fqn, module in self.model.named_modules():
                self._hook_handles.append(
                    module.register_forward_pre_hook(self._pre_hook(fqn), with_kwargs=True)
                )
                self._hook_handles.append(
                    module.register_forward_hook(self._post_hook(fqn), always_call=True)
                )
        super().__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _pre_hook(self, fqn: str) -> Any:
        def enter_module(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            _tag_autograd_nodes((args, kwargs), self._current_fqn())
            self._module_stack.append(fqn)

        return enter_module

    def _post_hook(self, fqn: str) -> Any:
        def leave_module(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            _tag_autograd_nodes(output, fqn)
            self._module_stack.pop()

        return leave_module

    def _current_fqn(self) -> str:
        return self._module_stack[-1] if self._module_stack else ""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not any(issubclass(tensor_type, DTensor) for tensor_type in types):
            return result
        node = _compat.current_autograd_node()
        if node is None:
            phase, module_fqn = FORWARD, self._current_fqn()
        else:
            phase, module_fqn = BACKWARD, node.metadata.get(MODULE_FQN_METADATA_KEY, "")
        record = DTensorOpRecord(
            op=str(func),
            module_fqn=module_fqn,
            phase=phase,
            input_placements=tuple(_dtensor_placements((args, kwargs))),
            output_placements=tuple(_dtensor_placements(result)),
        )
        self.records.append(record)
        LOGGER.log(self.level, "%s", record)
        return result


def log_dtensor_ops(model: nn.Module | None = None, *, level: int = logging.INFO) -> DTensorOpLogger:
    """A :class:`DTensorOpLogger` for ``model`` that logs at ``level`` (INFO by default).

    Example::

        logging.basicConfig(level=logging.INFO)
        with log_dtensor_ops(model) as op_logger:
            model(batch)
    """
    return DTensorOpLogger(model, level=level)
