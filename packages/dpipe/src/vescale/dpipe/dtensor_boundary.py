"""Hidden states of a tensor-parallel model crossing pipeline stages.

Under :func:`vescale.dmodule.parallelize_module` every parameter is a DTensor on the full
named mesh (``pp`` x ``tp``, Replicate on ``pp``), so the activations a stage computes are
DTensors on that mesh too. PyTorch's ``PipelineStage`` sends and receives plain tensors, so
a stage sends the local tensor of its hidden state made Replicate (on ``tp``: the full
hidden state; for sequence-parallel plans this is one all-gather per boundary) and the next
stage wraps what it receives back into a Replicate DTensor on its mesh. Both conversions are
differentiable: the gradient a stage sends back is the plain local gradient of that
Replicate DTensor, and a Partial gradient is reduced over ``tp`` by ``from_local``'s
backward before it leaves the stage.

Example::

    wire = to_wire(hidden_state)                 # plain tensor, the full hidden state
    hidden_state = from_wire(wire, stage_mesh)   # Replicate DTensor again on the receiver
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.dmodule.experts import is_expert_parameter

__all__ = ["from_wire", "local_tensor", "mesh_of", "to_wire"]


def mesh_of(module: nn.Module) -> DeviceMesh | None:
    """The mesh of ``module``'s DTensor parameters (``None`` for a plain module).

    Expert-parallel experts (:func:`vescale.dmodule.experts.parallelize_experts`) do not count:
    they are DTensors over ``ep`` while the rest of the model, and so its hidden state, may be
    plain (the experts take and give back whatever the model passes them).

    Example::

        mesh = mesh_of(stage_module)
        assert mesh is None or "tp" in mesh.mesh_dim_names
    """
    for parameter in module.parameters():
        if isinstance(parameter, DTensor) and not is_expert_parameter(parameter):
            return parameter.device_mesh
    return None


def to_wire(value: Any) -> Any:
    """``value`` as a plain tensor that holds the whole (Replicate) value; non-DTensors unchanged.

    Example::

        wire = to_wire(hidden_state)
        assert not isinstance(wire, DTensor)
    """
    if isinstance(value, DTensor):
        # ``to_local`` returns a view; the zero-bubble schedules ``detach_()`` stage outputs in
        # place after their input-gradient pass, which autograd refuses for views.
        return value.full_tensor().clone()
    return value


def from_wire(value: torch.Tensor | None, mesh: DeviceMesh | None) -> Any:
    """The received plain tensor as a Replicate DTensor on ``mesh`` (unchanged when ``mesh`` is None).

    Example::

        hidden_state = from_wire(received, mesh)
        assert hidden_state.placements == (Replicate(), Replicate())
    """
    if mesh is None or value is None:
        return value
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (without recording autograd), a plain tensor itself.

    Example::

        storage = local_tensor(parameter).untyped_storage()
    """
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()
