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
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial

from vescale.dmodule._attention_heads import HeadLayout, head_layouts_to_json, parse_head_layouts
from vescale.dmodule._plan_fqns import closest_names, compiled_pattern
from vescale.dmodule._plan_resolution import ResolvedSharding, ResolvedShardingPlan, resolve_plan
from vescale.dmodule._tensor_placements import (
    ForwardPlacements,
    TensorPlacements,
    parse_tensor_placements,
    tensor_placements_to_json,
)
from vescale.dmodule.errors import ShardingPlanError

# ForwardPlacements, TensorPlacements and the resolved types are owned by the two modules
# above and re-exported here, where users of a plan look for them.
__all__ = [
    "FORWARD_SUFFIXES",
    "PLAN_SECTIONS",
    "ForwardPlacements",
    "ResolvedSharding",
    "ResolvedShardingPlan",
    "ShardingPlan",
    "TensorPlacements",
]

PLAN_SECTIONS = ("parameter", "forward", "heads")
FORWARD_SUFFIXES = ("input", "output")


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
    heads: tuple[tuple[str, HeadLayout], ...] = ()
    """``(parameter pattern, HeadLayout)``: attention heads a tensor-parallel size must keep whole
    (see :mod:`vescale.dmodule._attention_heads`)."""

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
            (str(pattern), parse_tensor_placements(value, f"parameter['{pattern}']"))
            for pattern, value in _section(plan, "parameter").items()
        )
        forward = []
        for key, value in _section(plan, "forward").items():
            pattern, suffix = _split_forward_key(str(key))
            forward.append((pattern, suffix, ForwardPlacements.from_json(value, f"forward['{key}']")))
        heads = parse_head_layouts(_section(plan, "heads"))
        sharding_plan = cls(parameter=parameter, forward=tuple(forward), heads=heads)
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
        as_dict: dict[str, dict[str, Any]] = {
            "parameter": {pattern: tensor_placements_to_json(p) for pattern, p in self.parameter},
            "forward": forward,
        }
        if self.heads:
            as_dict["heads"] = head_layouts_to_json(self.heads)
        return as_dict

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text, as a user edits it."""
        return json.dumps(self.to_dict(), indent=indent)

    def patterns(self) -> list[str]:
        """Every pattern of the plan, parameters first, in plan order."""
        return (
            [pattern for pattern, _ in self.parameter]
            + [pattern for pattern, _, _ in self.forward]
            + [pattern for pattern, _ in self.heads]
        )

    def resolve(self, module: nn.Module, *, mesh_shape: Sequence[int], mesh_dim: int) -> ResolvedShardingPlan:
        """Match the plan against ``module``: per parameter FQN and per module FQN, what applies.

        Raises :class:`ShardingPlanError` for a pattern matching nothing (with the closest
        FQNs) and for a placement impossible for a tensor (FQN, shape, mesh size).

        Example::

            resolved = plan.resolve(model, mesh_shape=(2, 2), mesh_dim=1)
            print(resolved.format_table())
        """
        return resolve_plan(
            self.parameter,
            self.forward,
            module,
            mesh_shape=tuple(mesh_shape),
            mesh_dim=mesh_dim,
            heads=self.heads,
        )


def _section(plan: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = plan.get(name) or {}
    if not isinstance(section, Mapping):
        raise ShardingPlanError(
            f"plan[{name!r}] must be a dict of pattern -> placements, got {type(section).__name__}"
        )
    return section
