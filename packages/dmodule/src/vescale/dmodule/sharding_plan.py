"""The sharding plan of a DModule: which placements each parameter and each forward tensor takes.

A plan has veScale's form, in Python and in JSON alike::

    {
      "parameter": {r"model\\.layers\\.\\d+\\.mlp\\.up_proj\\.weight": "S(0)", ...},
      "forward":   {r"model\\.layers\\.\\d+\\.mlp.input": ["R"],
                    r"model\\.layers\\.\\d+\\.self_attn.input": {"hidden_states": "R"},
                    "lm_head.output": ["S(-1)"]}
    }

* ``parameter`` keys are regular expressions matched with ``re.fullmatch`` against parameter
  FQNs (``named_parameters()`` names); ``forward`` keys are a module-FQN pattern followed by
  ``.input`` or ``.output`` (a bare ``input``/``output`` names the root module).
* A tensor's placements are one placement, meaning that placement on the mesh dim the plan is
  applied to and Replicate on every other mesh dim, or a list with one placement per mesh
  dim. Placements are objects (``Shard(0)``, ``InterleavedShard(0, 3)``) or their short
  strings (``"S(0)"``, ``"R"``, ``"P"``, ``"IS(0,3)"``).
* A forward entry is a list (one item per positional argument or per output) or a dict (by
  keyword argument or output name); ``None`` leaves that tensor as it comes.
* **Precedence**: when several patterns match the same parameter or module, the entry that
  comes *last* in the plan wins, so an override is appended. :meth:`ShardingPlan.resolve`
  records which pattern decided each tensor.

Example::

    plan = ShardingPlan.from_dict({"parameter": {r"fc1\\.weight": "S(0)"}, "forward": {"fc1.input": ["R"]}})
    resolved = plan.resolve(model, mesh_shape=(2,), mesh_dim=0)
    resolved.parameters["fc1.weight"].placements   # (Shard(dim=0),)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Placement

from vescale.dmodule._plan_fqns import closest_names, compiled_pattern
from vescale.dmodule.errors import ShardingPlanError
from vescale.dtensor.placements import (
    InterleavedShard,
    PlacementError,
    placement_from_string,
    placement_to_string,
)

__all__ = [
    "FORWARD_SUFFIXES",
    "PLAN_SECTIONS",
    "ForwardPlacements",
    "ResolvedSharding",
    "ResolvedShardingPlan",
    "ShardingPlan",
    "TensorPlacements",
]

PLAN_SECTIONS = ("parameter", "forward")
FORWARD_SUFFIXES = ("input", "output")

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


def _parse_tensor_placements(value: Any, where: str) -> TensorPlacements:
    if isinstance(value, list | tuple):
        if not value:
            raise ShardingPlanError(f'{where}: an empty placement list; write e.g. "R" or ["R", "S(0)"]')
        return tuple(_parse_placement(item, where) for item in value)
    return (_parse_placement(value, where),)


def _tensor_placements_to_json(placements: TensorPlacements) -> str | list[str]:
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
                (str(name), None if item is None else _parse_tensor_placements(item, f"{where}[{name!r}]"))
                for name, item in value.items()
            )
            return cls(kwargs=kwargs)
        if isinstance(value, list | tuple):
            args = tuple(
                None if item is None else _parse_tensor_placements(item, f"{where}[{index}]")
                for index, item in enumerate(value)
            )
            return cls(args=args)
        raise ShardingPlanError(
            f"{where}: expected a list (one item per positional tensor) or a dict (by name), got "
            f'{value!r}; write e.g. ["R"] or {{"hidden_states": "S(1)"}}'
        )

    def to_json(self) -> list | dict:
        """The JSON form: a list when only positions are given, else a dict by name."""
        if self.kwargs and not self.args:
            return {name: None if p is None else _tensor_placements_to_json(p) for name, p in self.kwargs}
        if self.kwargs:
            raise ShardingPlanError("a forward entry mixes positions and names; give one or the other")
        return [None if p is None else _tensor_placements_to_json(p) for p in self.args]


def _split_forward_key(key: str) -> tuple[str, str]:
    if key in FORWARD_SUFFIXES:
        return "", key
    pattern, dot, suffix = key.rpartition(".")
    if not dot or suffix not in FORWARD_SUFFIXES:
        raise ShardingPlanError(
            f"forward key '{key}' must end in '.input' or '.output' (e.g. 'mlp.input'); use a bare "
            "'input' or 'output' for the root module"
        )
    return pattern, suffix


@dataclass(frozen=True)
class ShardingPlan:
    """A frozen sharding plan; entries keep their order (later entries win on overlap).

    Example::

        plan = ShardingPlan.from_dict({"parameter": {r"fc1\\.weight": "S(0)"}})
        assert ShardingPlan.from_json(plan.to_json()) == plan
    """

    parameter: tuple[tuple[str, TensorPlacements], ...] = ()
    forward: tuple[tuple[str, str, ForwardPlacements], ...] = ()
    """``(module pattern, "input" | "output", placements)`` entries."""

    @classmethod
    def from_dict(cls, plan: Mapping[str, Any] | ShardingPlan) -> ShardingPlan:
        """Parse the Python or JSON-loaded form (see the module docstring)."""
        if isinstance(plan, ShardingPlan):
            return plan
        if not isinstance(plan, Mapping):
            raise ShardingPlanError(
                f"a sharding plan is a dict with the keys {PLAN_SECTIONS}, got {type(plan).__name__}"
            )
        for key in plan:
            if key not in PLAN_SECTIONS:
                suggestion = closest_names(str(key), PLAN_SECTIONS, count=1)
                hint = f"; did you mean {suggestion[0]!r}?" if suggestion else ""
                raise ShardingPlanError(f"unknown plan key '{key}'{hint} A plan has the keys {PLAN_SECTIONS}")
        parameter = tuple(
            (str(pattern), _parse_tensor_placements(value, f"parameter['{pattern}']"))
            for pattern, value in _section(plan, "parameter").items()
        )
        forward = []
        for key, value in _section(plan, "forward").items():
            pattern, suffix = _split_forward_key(str(key))
            forward.append((pattern, suffix, ForwardPlacements.from_json(value, f"forward['{key}']")))
        sharding_plan = cls(parameter=parameter, forward=tuple(forward))
        for pattern in sharding_plan.patterns():
            compiled_pattern(pattern)
        for pattern, placements in parameter:
            if any(isinstance(placement, Partial) for placement in placements):
                raise ShardingPlanError(
                    f"parameter['{pattern}']: a parameter cannot be Partial (a pending sum); use 'R' "
                    "or a Shard"
                )
        return sharding_plan

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        """Parse a plan from its JSON text."""
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as error:
            raise ShardingPlanError(f"the sharding plan is not valid JSON: {error}") from None
        return cls.from_dict(loaded)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The JSON-able form, placements as short strings; ``from_dict`` reads it back equal."""
        forward = {}
        for pattern, suffix, placements in self.forward:
            forward[f"{pattern}.{suffix}" if pattern else suffix] = placements.to_json()
        return {
            "parameter": {pattern: _tensor_placements_to_json(p) for pattern, p in self.parameter},
            "forward": forward,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text, as a user edits it."""
        return json.dumps(self.to_dict(), indent=indent)

    def patterns(self) -> list[str]:
        """Every pattern of the plan, parameters first, in plan order."""
        return [pattern for pattern, _ in self.parameter] + [pattern for pattern, _, _ in self.forward]

    def resolve(self, module: nn.Module, *, mesh_shape: Sequence[int], mesh_dim: int) -> ResolvedShardingPlan:
        """Match the plan against ``module``: per parameter FQN and per module FQN, what applies.

        Raises :class:`ShardingPlanError` for a pattern matching nothing (with the closest
        FQNs) and for a placement impossible for a tensor (FQN, shape, mesh size).

        Example::

            resolved = plan.resolve(model, mesh_shape=(2, 2), mesh_dim=1)
            print(resolved.format_table())
        """
        from vescale.dmodule._plan_resolution import resolve_plan

        return resolve_plan(self, module, tuple(mesh_shape), mesh_dim)


def _section(plan: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = plan.get(name) or {}
    if not isinstance(section, Mapping):
        raise ShardingPlanError(
            f"plan[{name!r}] must be a dict of pattern -> placements, got {type(section).__name__}"
        )
    return section


@dataclass(frozen=True)
class ResolvedSharding:
    """What the plan decided for one tensor: full-mesh placements and the deciding pattern."""

    placements: tuple[AnyPlacement, ...]
    pattern: str


@dataclass(frozen=True)
class ResolvedShardingPlan:
    """A plan matched against one module (see :meth:`ShardingPlan.resolve`).

    Example::

        resolved.parameters["lm_head.weight"]       # ResolvedSharding((Shard(dim=0),), 'lm_head\\.weight')
        resolved.inputs["model.layers.0.mlp"]        # ForwardPlacements on the full mesh
    """

    parameters: Mapping[str, ResolvedSharding] = field(default_factory=dict)
    inputs: Mapping[str, tuple[ForwardPlacements, str]] = field(default_factory=dict)
    outputs: Mapping[str, tuple[ForwardPlacements, str]] = field(default_factory=dict)

    def format_table(self) -> str:
        """One line per sharded parameter and per forward hook: FQN, placements, pattern."""
        rows = [("parameter", fqn, _text(s.placements), s.pattern) for fqn, s in self.parameters.items()]
        for kind, entries in (("input", self.inputs), ("output", self.outputs)):
            rows += [(kind, fqn, json.dumps(p.to_json()), pattern) for fqn, (p, pattern) in entries.items()]
        header = ("kind", "fqn", "placements", "from pattern")
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]
        )


def _text(placements: Sequence[AnyPlacement]) -> str:
    return "[" + ", ".join(placement_to_string(p) for p in placements) + "]"
