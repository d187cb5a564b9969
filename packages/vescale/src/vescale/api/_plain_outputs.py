"""Outputs computed without gradients come back as the plain full tensors one device returns.

Under tensor parallelism the model's outputs are DTensors: the logits sharded over the
vocabulary (the loss runs on the shards), hidden states sharded over the sequence with
sequence parallelism. Code written for one device that reads them fails on a DTensor mixed with
a plain tensor: ``transformers``' ``generate`` (``next_tokens * unfinished_sequences``), an
evaluation loop's ``logits.argmax(-1) == labels``. So a call of the model under
``torch.no_grad()`` or ``torch.inference_mode()`` (``generate`` runs under ``no_grad``) gathers
each DTensor of its output into the full tensor, the same on every rank: one all-gather of
the logits per call, which such code needs anyway. With gradients (training) the outputs
stay DTensors, so the step pays no gather it does not use; ``.full_tensor()`` gives the
value there.

Example::

    plain_outputs_without_grad(model)   # vescale.parallelize does this
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=16)   # as on one device
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

__all__ = ["plain_outputs_without_grad"]


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_full(item) for item in value)
    if isinstance(value, list):
        return [_full(item) for item in value]
    return value


def _full_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    if torch.is_grad_enabled():
        return None
    if isinstance(output, MutableMapping):  # a transformers ModelOutput: its keys are its fields
        for key in list(output.keys()):
            output[key] = _full(output[key])
        return output
    return _full(output)


def plain_outputs_without_grad(model: nn.Module) -> RemovableHandle:
    """Make ``model``'s calls without gradients return plain full tensors (module docstring).

    Example::

        handle = plain_outputs_without_grad(model)
        handle.remove()   # DTensor outputs again
    """
    return model.register_forward_hook(_full_outputs)
