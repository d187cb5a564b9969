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
from torch.distributed.tensor import DTensor

__all__ = ["buffers_kept", "generators_kept", "model_state_kept"]

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


def _values_of(buffer: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding ``buffer``'s values on this rank (a DTensor's local shard), or None
    where it holds none to write (meta, fake or deferred)."""
    if isinstance(buffer, DTensor):
        buffer = buffer.to_local()
    if type(buffer) is not torch.Tensor or buffer.is_meta:
        return None
    return buffer


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Run the body, then give every buffer of ``model`` its values back (BatchNorm's statistics);
    on a DTensor buffer, this rank's shard. The module structure is left as the body leaves it.

    Example::

        with torch.no_grad(), buffers_kept(parallel_model):
            parallel_model(**probe_batch)          # a probe forward: no statistics updated
    """
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for buffer in model.buffers():
        values = _values_of(buffer)
        if values is not None and id(values) not in saved:
            saved[id(values)] = (values, values.detach().clone())
    try:
        yield
    finally:
        with torch.no_grad():
            for values, value in saved.values():
                if not torch.equal(values, value):
                    values.copy_(value)


@contextlib.contextmanager
def model_state_kept(model: nn.Module) -> Iterator[None]:
    """Run the body, then give every module of ``model`` back its attributes, submodules,
    parameters, buffers and buffer values, and the generators their states (module docstring).

    For a model not yet parallelized (a planning trace): parameters' values are not copied (a
    forward does not write them); buffers' are, where they hold data (:func:`buffers_kept`).

    Example::

        with model_state_kept(model):
            model(input_ids)
    """
    modules = {id(module): (module, *_snapshot(module)) for module in model.modules()}
    try:
        with buffers_kept(model), generators_kept(model):
            yield
    finally:
        for module, attributes, containers in modules.values():
            _restore(module, attributes, containers)
