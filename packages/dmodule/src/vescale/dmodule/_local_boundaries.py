"""The placement conversions met inside a module's forward, recorded once and replayed on local tensors.

Local execution (:mod:`vescale.dmodule.local_execution`) runs a module's forward on plain local
tensors. The plan's conversions inside it (a projection's input made Replicate, a row-parallel
output reduced) still have to happen, with the placements and gradient placements the DTensor
forward had. :class:`BoundaryRecording` notes each conversion of a DTensor forward, in order: the
source and result layouts, and, once a backward has run through it, the placements its gradient
arrived in. :class:`BoundaryReplay` makes the same conversions on local tensors: it wraps the local
value in the recorded source layout, converts it as the DTensor forward did, and hands the result on
as a local tensor whose gradient is read in the recorded placements. A conversion that differs from
the recording (another place in the code, a different result layout, one more or one fewer) raises
:class:`LocalReplayDiverged`, so a forward whose path changed is never run on wrong layouts.

Example::

    recording = BoundaryRecording()
    with running_boundaries(recording):
        block.forward(hidden)                     # DTensors; conversions noted
    with running_boundaries(BoundaryReplay(recording.boundaries)):
        block.forward(hidden.to_local())          # the same conversions, on local tensors
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = [
    "Boundary",
    "BoundaryRecording",
    "BoundaryReplay",
    "LocalReplayDiverged",
    "TensorLayout",
    "current_boundaries",
    "running_boundaries",
]

Convert = Callable[[Any, DeviceMesh, Any, str], Any]


class _ThreadState(threading.local):
    # A class default, so that the attribute always exists: torch.compile guards on whether it
    # does, and a block compiled before the first local run would compile again after it.
    active: BoundaryRecording | BoundaryReplay | None = None


_STATE = _ThreadState()


class LocalReplayDiverged(Exception):
    """A local forward made other conversions than the verified DTensor forward did."""


@dataclass(frozen=True)
class TensorLayout:
    """How a DTensor lays out: enough to wrap its local tensor again without communication."""

    mesh: DeviceMesh
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @staticmethod
    def of(value: DTensor) -> TensorLayout:
        return TensorLayout(value.device_mesh, tuple(value.placements), value.shape, value.stride())

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` as the DTensor this layout describes (no communication, no check)."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


@dataclass
class Boundary:
    """One conversion of the recorded forward; ``gradient`` is filled in when backward passes it."""

    where: str
    source: TensorLayout | None  # None: a plain tensor, taken as the full value
    result: TensorLayout
    gradient: tuple[Any, ...] | None = None


class _NoteGradientPlacements(torch.autograd.Function):
    """Identity that notes the placements of the gradient passing back through it."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, boundary: Boundary) -> DTensor:
        ctx.boundary = boundary
        viewed: DTensor = value.view_as(value)  # type: ignore[assignment]  # a DTensor op returns a DTensor
        return viewed

    @staticmethod
    def backward(ctx: Any, gradient: Any) -> tuple[Any, None]:
        if isinstance(gradient, DTensor):
            ctx.boundary.gradient = tuple(gradient.placements)
        return gradient, None


class BoundaryRecording:
    """Converts as usual and notes each conversion (see the module docstring)."""

    def __init__(self) -> None:
        self.boundaries: list[Boundary] = []

    def convert(
        self, value: torch.Tensor, mesh: DeviceMesh, placements: Any, where: str, convert: Convert
    ) -> Any:
        result = convert(value, mesh, placements, where)
        if not isinstance(result, DTensor):
            raise LocalReplayDiverged(
                f"{where}: the conversion gave a {type(result).__name__}, not a DTensor"
            )
        source = TensorLayout.of(value) if isinstance(value, DTensor) else None
        boundary = Boundary(where, source, TensorLayout.of(result))
        self.boundaries.append(boundary)
        if result.requires_grad:
            result = _NoteGradientPlacements.apply(result, boundary)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return result


class BoundaryReplay:
    """Makes the recorded conversions on local tensors, in order (see the module docstring)."""

    def __init__(self, boundaries: list[Boundary]) -> None:
        self._boundaries = boundaries
        self._position = 0

    def convert(
        self, value: torch.Tensor, mesh: DeviceMesh, placements: Any, where: str, convert: Convert
    ) -> Any:
        if self._position >= len(self._boundaries):
            raise LocalReplayDiverged(f"{where}: a conversion the verified forward did not make")
        boundary = self._boundaries[self._position]
        self._position += 1
        if boundary.where != where or isinstance(value, DTensor):
            raise LocalReplayDiverged(f"{where}: the verified forward converted {boundary.where} here")
        entering = value if boundary.source is None else boundary.source.wrap(value)
        result = convert(entering, mesh, placements, where)
        if not isinstance(result, DTensor) or tuple(result.placements) != boundary.result.placements:
            raise LocalReplayDiverged(f"{where}: the conversion's result differs from the verified forward's")
        return result.to_local(grad_placements=boundary.gradient)

    def finish(self) -> None:
        """Raise unless every recorded conversion was made."""
        if self._position != len(self._boundaries):
            missing = self._boundaries[self._position].where
            raise LocalReplayDiverged(f"{missing}: the verified forward converted here, this one did not")


def current_boundaries() -> BoundaryRecording | BoundaryReplay | None:
    """The recording or replay active on this thread, if any."""
    return _STATE.active


@contextlib.contextmanager
def running_boundaries(active: BoundaryRecording | BoundaryReplay | None) -> Iterator[None]:
    """Route this thread's plan conversions through ``active`` inside the block."""
    saved = current_boundaries()
    _STATE.active = active
    try:
        yield
    finally:
        _STATE.active = saved
