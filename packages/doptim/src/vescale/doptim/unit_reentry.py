"""A ZeRO-3 unit's inner modules, called outside the unit's forward, gather its parameters first.

FSDP2 all-gathers a unit's parameters when the unit's forward starts, and before its backward
from hooks on the forward's outputs. Some models call a unit's inner modules without the unit's
forward: Reformer's reversible layers keep no activations and, in the backward of their
autograd Function, recompute ``layer.attention(...)`` and ``layer.feed_forward(...)`` directly
(the forward ran under ``no_grad``, so no backward hook was registered either). Those calls met
the dp shards of the parameters: "got mixed torch.Tensor and DTensor" under FSDP2 alone, a
shape error on a dp x tp mesh.

:func:`gather_on_reentry` counts, per unit, the forwards of the unit now running, and gives
every inner module that holds parameters a forward pre-hook: called while none runs, it unshards
the unit (FSDP2's public ``FSDPModule.unshard``, a no-op when the unit is gathered already). The
gradients of such a recomputation accumulate on the gathered parameters, and FSDP2's
end-of-backward callback runs the post-backward of every unit whose backward hooks did not fire:
it reshards and reduce-scatters them, so each shard gets the gradient one device computes. Until
then that unit's parameters stay gathered (ZeRO-2's memory for it, for the rest of that
backward). Inside a unit's own forward the hook does nothing.

Example::

    fully_shard(block); fully_shard(model)
    gather_on_reentry(model)   # after every fully_shard: each unit's inner modules
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["gather_on_reentry"]

REENTRY_HOOKED = "_vescale_gather_on_reentry"


def _inner_modules(unit: nn.Module) -> Iterator[nn.Module]:
    """The modules below ``unit`` that no nested FSDP unit owns."""
    for child in unit.children():
        if isinstance(child, FSDPModule):
            continue
        yield child
        yield from _inner_modules(child)


class _UnitForwards:
    """How many forwards of ``unit`` are running; its inner modules' pre-hook gathers it at none."""

    def __init__(self, unit: FSDPModule) -> None:
        self.unit = unit
        self.running = 0

    def enter(self, module: nn.Module, args: Any) -> None:
        self.running += 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.running -= 1

    def gather_if_outside(self, module: nn.Module, args: Any) -> None:
        if not self.running:
            self.unit.unshard()


def gather_on_reentry(model: nn.Module) -> None:
    """Hook every FSDP unit's inner modules in ``model`` to gather the unit when called alone (idempotent).

    Call it after the last ``fully_shard`` (a nested unit's modules are its own, not its parent's).

    Example::

        gather_on_reentry(model)
        model.blocks[0].attention(hidden)   # gathers blocks[0]'s parameters first
    """
    for unit in model.modules():
        if not isinstance(unit, FSDPModule) or getattr(unit, REENTRY_HOOKED, False):
            continue
        forwards = _UnitForwards(unit)
        unit.register_forward_pre_hook(forwards.enter, prepend=True)
        unit.register_forward_hook(forwards.leave, always_call=True)
        for module in _inner_modules(unit):
            if any(True for _ in module.parameters(recurse=False)):
                # Before any other pre-hook (a tensor-parallel module's input layout may read them).
                module.register_forward_pre_hook(forwards.gather_if_outside, prepend=True)
        setattr(unit, REENTRY_HOOKED, True)
