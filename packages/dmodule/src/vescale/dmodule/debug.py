"""Seeing what a DModule did: every parameter's placements, every forward hook's placements,
and errors that name the module they happened in.

:func:`format_placements` prints one table of a parallelized module. :func:`name_failing_modules`
adds a note to an exception raised during a forward with the FQN of the innermost module that
was running and the placements of the DTensors it was given, so that "aten.mm got
incompatible placements" says where in the model it happened.

Example::

    print(format_placements(model))
    # parameter  model.layers.0.mlp.up_proj.weight  (64, 32)  [S(0)]  local (32, 32)
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from vescale.dtensor.placements import placement_to_string

__all__ = [
    "NOTE_PREFIX",
    "describe_tensors",
    "format_placements",
    "name_failing_modules",
    "stop_naming_failures",
]

# The hook name_failing_modules put on each module, for stop_naming_failures.
_FAILURE_NOTES: weakref.WeakKeyDictionary[nn.Module, list[RemovableHandle]] = weakref.WeakKeyDictionary()

NOTE_PREFIX = "[vescale.dmodule] while running module"


def _placements_text(tensor: DTensor) -> str:
    return "[" + ", ".join(placement_to_string(placement) for placement in tensor.placements) + "]"


def describe_tensors(values: Any) -> str:
    """``"0: (2, 8, 32) [R, S(1)], 1: plain (2, 8)"`` for the tensors among ``values``."""
    flat = list(values.items()) if isinstance(values, dict) else list(enumerate(values))
    parts = []
    for key, value in flat:
        if isinstance(value, DTensor):
            parts.append(f"{key}: {tuple(value.shape)} {_placements_text(value)}")
        elif isinstance(value, torch.Tensor):
            parts.append(f"{key}: plain {tuple(value.shape)}")
    return ", ".join(parts) or "no tensors"


def format_placements(module: nn.Module) -> str:
    """A table of every parameter (global shape, placements, local shape) and forward hook.

    Example::

        print(format_placements(parallelize_module(model, mesh, plan)))
    """
    rows = [("kind", "fqn", "global shape", "placements", "local shape")]
    for fqn, parameter in module.named_parameters():
        if isinstance(parameter, DTensor):
            local = tuple(parameter.to_local().shape)
            rows.append(
                ("parameter", fqn, str(tuple(parameter.shape)), _placements_text(parameter), str(local))
            )
        else:
            rows.append(("parameter", fqn, str(tuple(parameter.shape)), "plain", str(tuple(parameter.shape))))
    state = getattr(module, "_vescale_dmodule", None)
    if state is not None:
        for kind, entries in (("input", state.resolved.inputs), ("output", state.resolved.outputs)):
            for fqn, (placements, pattern) in entries.items():
                rows.append(
                    (kind, fqn or "<root>", "", str(placements.to_json()), f"from {pattern or '<root>'}")
                )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def name_failing_modules(module: nn.Module) -> list[RemovableHandle]:
    """Make an exception raised in a forward of ``module`` name the innermost submodule running.

    Example::

        handles = name_failing_modules(model)
        model(input_ids)   # an error now carries a note "... module 'model.layers.0.self_attn' ..."
    """
    handles = []
    for fqn, submodule in module.named_modules():

        def note_failure(
            hooked: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, fqn: str = fqn
        ) -> None:
            # On the exception path torch calls always_call hooks with no output.
            error = sys.exc_info()[1] if output is None else None
            if error is None or not hasattr(error, "add_note"):
                return
            if any(note.startswith(NOTE_PREFIX) for note in getattr(error, "__notes__", ())):
                return  # an inner module has named itself already
            error.add_note(
                f"{NOTE_PREFIX} {fqn or '<root>'!r} ({type(hooked).__name__}) with inputs "
                f"{describe_tensors(args)}; keyword inputs {describe_tensors(kwargs)}"
            )

        handle = submodule.register_forward_hook(note_failure, with_kwargs=True, always_call=True)
        _FAILURE_NOTES.setdefault(submodule, []).append(handle)
        handles.append(handle)
    return handles


def stop_naming_failures(module: nn.Module) -> None:
    """Remove the hooks of :func:`name_failing_modules` from ``module`` and its submodules.

    For code that ``torch.compile`` traces: a hook that runs even on the exception path is
    guarded by its own id, which differs between the blocks of a model, so each block would
    compile on its own; dynamo's own error names the failing line of the traced code.

    Example::

        stop_naming_failures(model.model.layers[0])
    """
    for submodule in module.modules():
        for handle in _FAILURE_NOTES.pop(submodule, []):
            handle.remove()
