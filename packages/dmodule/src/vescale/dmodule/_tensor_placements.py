"""The placements a sharding plan gives one tensor, and a module's inputs or outputs.

A tensor's placements are one placement (for the plan's mesh dim) or one per mesh dim, given
as objects (``Shard(0)``) or their short strings (``"S(0)"``, ``"R"``, ``"P"``, ``"IS(0,3)"``).
A :class:`ForwardPlacements` names them per positional tensor or per keyword. This module
only parses and prints them; the plan (``sharding_plan``) and its resolution against a module
(``_plan_resolution``) both build on it.

Example::

    parse_tensor_placements(["R", "S(0)"], "parameter['fc1.weight']")   # (Replicate(), Shard(dim=0))
    ForwardPlacements.from_json({"hidden_states": "S(1)"}).to_json()      # {'hidden_states': 'S(1)'}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Placement

from vescale.dmodule.errors import ShardingPlanError
from vescale.dtensor.placements import (
    InterleavedShard,
    PlacementError,
    placement_from_string,
    placement_to_string,
)

__all__ = [
    "AnyPlacement",
    "ForwardPlacements",
    "TensorPlacements",
    "parse_tensor_placements",
    "tensor_placements_to_json",
]

AnyPlacement = Placement | InterleavedShard
TensorPlacements = tuple[AnyPlacement, ...]
"""One placement (for the plan's mesh dim) or one per mesh dim."""


def _parse_placement(value: Any, where: str) -> AnyPlacement:
    if isinstance(value, Placement | InterleavedShard):
        return value
    try:
        return placement_from_string(value)
    except PlacementError as error:
        raise ShardingPlanError(f"{where}: {error}") from None


def parse_tensor_placements(value: Any, where: str) -> TensorPlacements:
    """One placement or a list of them (objects or short strings) as a tuple of placements.

    ``where`` names the plan entry in the :class:`ShardingPlanError` raised for a bad value.

    Example::

        parse_tensor_placements("S(0)", "parameter['fc1.weight']")   # (Shard(dim=0),)
    """
    if isinstance(value, list | tuple):
        if not value:
            raise ShardingPlanError(f'{where}: an empty placement list; write e.g. "R" or ["R", "S(0)"]')
        return tuple(_parse_placement(item, where) for item in value)
    return (_parse_placement(value, where),)


def tensor_placements_to_json(placements: TensorPlacements) -> str | list[str]:
    """The JSON form: one short string for one placement, else a list of them.

    Example::

        tensor_placements_to_json((Replicate(), Shard(0)))   # ['R', 'S(0)']
    """
    texts = [placement_to_string(placement) for placement in placements]
    return texts[0] if len(texts) == 1 else texts


@dataclass(frozen=True)
class ForwardPlacements:
    """Placements of a module's positional and keyword tensors (inputs) or of its outputs.

    Example::

        ForwardPlacements.from_json(["R", None]).args            # ((Replicate(),), None)
        ForwardPlacements.from_json({"hidden_states": "S(1)"}).kwargs
    """

    args: tuple[TensorPlacements | None, ...] = ()
    kwargs: tuple[tuple[str, TensorPlacements | None], ...] = ()

    @classmethod
    def from_json(cls, value: Any, where: str = "forward") -> ForwardPlacements:
        """Parse a list (by position) or dict (by name) of per-tensor placements."""
        if isinstance(value, ForwardPlacements):
            return value
        if isinstance(value, Mapping):
            kwargs = tuple(
                (str(name), None if item is None else parse_tensor_placements(item, f"{where}[{name!r}]"))
                for name, item in value.items()
            )
            return cls(kwargs=kwargs)
        if isinstance(value, list | tuple):
            args = tuple(
                None if item is None else parse_tensor_placements(item, f"{where}[{index}]")
                for index, item in enumerate(value)
            )
            return cls(args=args)
        raise ShardingPlanError(
            f"{where}: expected a list (one item per positional tensor) or a dict (by name), got "
            f'{value!r}; write e.g. ["R"] or {{"hidden_states": "S(1)"}}'
        )

    def to_json(self) -> list[Any] | dict[str, Any]:
        """The JSON form: a list when only positions are given, else a dict by name."""
        if self.kwargs and not self.args:
            return {name: None if p is None else tensor_placements_to_json(p) for name, p in self.kwargs}
        if self.kwargs:
            raise ShardingPlanError("a forward entry mixes positions and names; give one or the other")
        return [None if p is None else tensor_placements_to_json(p) for p in self.args]
