"""A forward run for planning leaves the model and the generators as they were.

The automatic plan traces one forward of the user's model. That forward may change the model:
BigBird's swaps its block-sparse attention modules for full ones when the sequence is short
(building new ``nn.Linear`` modules, whose initialisation draws random numbers), BatchNorm
updates its running statistics, ``transformers`` modules fill caches. A single-device run does
those things in its own first forward, drawing from the generator there; if planning did them
first, the parallel run's first forward would skip them and every later random draw (dropout)
would come from another point of the stream. So the trace runs under :func:`model_state_kept`:
afterwards every module holds the attributes, submodules, parameters and buffers it held before,
the buffers hold their values, and the CPU generator (and each accelerator's holding the model)
is where it was.

Example::

    with model_state_kept(model):
        model(**example_batch)          # BigBird's attention swap, BatchNorm statistics: undone
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["generators_kept", "model_state_kept"]

_CONTAINERS = ("_modules", "_parameters", "_buffers")


@contextlib.contextmanager
def generators_kept(model: nn.Module) -> Iterator[None]:
    """The CPU generator, and the current one of each accelerator holding ``model``, as they were.

    Example::

        with generators_kept(model):
            torch.rand(3)               # the caller's next draw is unchanged
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for device_type in sorted({p.device.type for p in model.parameters()} - {"cpu", "meta"}):
            device = torch.get_device_module(device_type).current_device()
            stack.enter_context(torch.random.fork_rng(devices=[device], device_type=device_type))
        yield


def _snapshot(module: nn.Module) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    attributes = dict(module.__dict__)
    containers = {name: dict(module.__dict__[name]) for name in _CONTAINERS if name in module.__dict__}
    return attributes, containers


def _restore(module: nn.Module, attributes: dict[str, Any], containers: dict[str, dict[str, Any]]) -> None:
    for name, content in containers.items():
        # The same container objects, refilled: code may hold a reference to them.
        container = attributes[name]
        container.clear()
        container.update(content)
    module.__dict__.clear()
    module.__dict__.update(attributes)


@contextlib.contextmanager
def model_state_kept(model: nn.Module) -> Iterator[None]:
    """Run the body, then give every module of ``model`` back its attributes, submodules,
    parameters, buffers and buffer values, and the generators their states (module docstring).

    Parameters' values are not copied (a forward does not write them); buffers' are, where they
    hold data (not on the meta device, not fake or deferred).

    Example::

        with model_state_kept(model):
            model(input_ids)
    """
    modules = {id(module): (module, *_snapshot(module)) for module in model.modules()}
    buffer_values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for buffer in model.buffers():
        # Plain tensors with data only: a meta, fake or deferred buffer holds no values to write.
        if type(buffer) is torch.Tensor and not buffer.is_meta and id(buffer) not in buffer_values:
            buffer_values[id(buffer)] = (buffer, buffer.detach().clone())
    try:
        with generators_kept(model):
            yield
    finally:
        for module, attributes, containers in modules.values():
            _restore(module, attributes, containers)
        with torch.no_grad():
            for buffer, value in buffer_values.values():
                if not torch.equal(buffer, value):
                    buffer.copy_(value)
