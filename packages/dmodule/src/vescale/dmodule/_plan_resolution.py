"""Matching a sharding plan's entries against a module, and the result: :class:`ResolvedShardingPlan`.

Each parameter FQN and module FQN gets the placements of the last plan entry whose pattern
matches it (the documented precedence), expanded to one placement per mesh dim. Every
pattern must match something, tied parameters must agree, and every parameter placement
must be possible for the parameter's shape; the errors name the FQN, the shape, the mesh
and the fix. Nothing is applied here: resolution either succeeds whole or raises.

This module reads the plan's entries, not the plan type, so that
:class:`~vescale.dmodule.sharding_plan.ShardingPlan` (whose ``resolve`` calls
:func:`resolve_plan`) is the one owner of the plan and nothing here imports it back.

Example::

    resolved = resolve_plan(plan.parameter, plan.forward, model, mesh_shape=(2,), mesh_dim=0)
    resolved.parameters["fc1.weight"].placements   # (Shard(dim=0),)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from vescale.dmodule._attention_heads import HeadLayout, apply_head_layouts
from vescale.dmodule._plan_fqns import compiled_pattern, no_match_message
from vescale.dmodule._tensor_placements import AnyPlacement, ForwardPlacements, TensorPlacements
from vescale.dmodule.errors import ShardingPlanError
from vescale.dtensor.placements import InterleavedShard, placement_to_string

__all__ = ["ResolvedSharding", "ResolvedShardingPlan", "resolve_plan"]

_LOGGER = logging.getLogger("vescale.dmodule")

ParameterEntries = Sequence[tuple[str, TensorPlacements]]
ForwardEntries = Sequence[tuple[str, str, ForwardPlacements]]


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
        rows = [("parameter", fqn, _describe(s.placements), s.pattern) for fqn, s in self.parameters.items()]
        for kind, entries in (("input", self.inputs), ("output", self.outputs)):
            rows += [(kind, fqn, json.dumps(p.to_json()), pattern) for fqn, (p, pattern) in entries.items()]
        header = ("kind", "fqn", "placements", "from pattern")
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]
        )


def _on_full_mesh(
    placements: TensorPlacements, mesh_shape: tuple[int, ...], mesh_dim: int, where: str
) -> TensorPlacements:
    if len(placements) == len(mesh_shape):
        return placements
    if len(placements) == 1:
        full: list[Placement | InterleavedShard] = [Replicate()] * len(mesh_shape)
        full[mesh_dim] = placements[0]
        return tuple(full)
    raise ShardingPlanError(
        f"{where}: {len(placements)} placements for a {len(mesh_shape)}-dim mesh of shape {mesh_shape}; "
        f"give one placement (applied on mesh dim {mesh_dim}) or one per mesh dim"
    )


def _forward_on_full_mesh(
    placements: ForwardPlacements, mesh_shape: tuple[int, ...], mesh_dim: int, where: str
) -> ForwardPlacements:
    def expand(item: TensorPlacements | None, label: str) -> TensorPlacements | None:
        return None if item is None else _on_full_mesh(item, mesh_shape, mesh_dim, f"{where}{label}")

    return ForwardPlacements(
        args=tuple(expand(item, f"[{index}]") for index, item in enumerate(placements.args)),
        kwargs=tuple((name, expand(item, f"[{name!r}]")) for name, item in placements.kwargs),
    )


def _check_possible(
    fqn: str, shape: Sequence[int], placements: TensorPlacements, mesh_shape: tuple[Any, ...]
) -> None:
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard | InterleavedShard):
            continue
        problem = ""
        if not -len(shape) <= placement.dim < len(shape):
            problem = f"tensor dim {placement.dim} does not exist"
        elif isinstance(placement, InterleavedShard) and shape[placement.dim] % placement.interleaved_size:
            problem = (
                f"dim {placement.dim % len(shape)} of size {shape[placement.dim]} is not "
                f"{placement.interleaved_size} equal fused parts"
            )
        if problem:
            raise ShardingPlanError(
                f"parameter {fqn!r} of shape {tuple(shape)} cannot take {placement_to_string(placement)} "
                f"on mesh dim {mesh_dim} (size {mesh_shape[mesh_dim]}): {problem}; give it a placement "
                f'for one of its dims 0..{len(shape) - 1}, or "R"'
            )


def _replicate_dims_too_small(
    fqn: str, shape: Sequence[int], placements: TensorPlacements, mesh_shape: tuple[Any, ...]
) -> TensorPlacements:
    """``placements`` with Replicate where a Shard would split fewer rows than the mesh dim has ranks.

    A BERT token-type table (2 rows) vocab-parallel over 4 ranks leaves two ranks an empty shard,
    and DTensor refuses the in-place update of such a shard (gradient accumulation's ``add_``:
    "in-place operations that require placement changes are not supported"). Replicating it
    computes the same values and saves nothing less than the empty shards would.
    """
    adjusted = list(placements)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard | InterleavedShard) and shape[placement.dim] < mesh_shape[mesh_dim]:
            _LOGGER.warning(
                "parameter %r of shape %s: %s on mesh dim %d would split %d rows over %d ranks; replicated",
                fqn,
                tuple(shape),
                placement_to_string(placement),
                mesh_dim,
                shape[placement.dim],
                mesh_shape[mesh_dim],
            )
            adjusted[mesh_dim] = Replicate()
    return tuple(adjusted)


def _check_tied(parameters: dict[str, nn.Parameter], resolved: dict[str, ResolvedSharding]) -> None:
    owners: dict[int, str] = {}
    for fqn, parameter in parameters.items():
        first = owners.setdefault(id(parameter), fqn)
        if first == fqn:
            continue
        first_placements = resolved[first].placements if first in resolved else None
        placements = resolved[fqn].placements if fqn in resolved else None
        if first_placements != placements:
            raise ShardingPlanError(
                f"parameters {first!r} and {fqn!r} are one tied tensor but the plan gives them different "
                f"placements ({_describe(first_placements)} and {_describe(placements)}); give both the same"
            )


def _describe(placements: Sequence[AnyPlacement] | None) -> str:
    if placements is None:
        return "none"
    return "[" + ", ".join(placement_to_string(placement) for placement in placements) + "]"


def resolve_plan(
    parameter: ParameterEntries,
    forward: ForwardEntries,
    module: nn.Module,
    *,
    mesh_shape: tuple[int, ...],
    mesh_dim: int,
    heads: Sequence[tuple[str, HeadLayout]] = (),
) -> ResolvedShardingPlan:
    """What a plan's ``parameter`` and ``forward`` entries decide for each parameter and module
    of ``module`` (see the module docstring); later entries win on overlap. ``heads`` entries
    replicate key/value projections with fewer heads than ranks, or refuse a size that would
    split query heads (:mod:`vescale.dmodule._attention_heads`).

    Example::

        resolved = resolve_plan(plan.parameter, plan.forward, model, mesh_shape=(2,), mesh_dim=0)
        print(resolved.format_table())
    """
    if not 0 <= mesh_dim < len(mesh_shape):
        raise ShardingPlanError(
            f"mesh dim {mesh_dim} does not exist in a mesh of shape {mesh_shape}; "
            f"choose 0..{len(mesh_shape) - 1}"
        )
    parameters = dict(module.named_parameters(remove_duplicate=False))
    resolved_parameters: dict[str, ResolvedSharding] = {}
    for pattern, placements in parameter:
        where = f"parameter['{pattern}']"
        regex = compiled_pattern(pattern)
        matched = [fqn for fqn in parameters if regex.fullmatch(fqn)]
        if not matched:
            raise ShardingPlanError(no_match_message("parameter", pattern, pattern, "parameter", parameters))
        full = _on_full_mesh(placements, mesh_shape, mesh_dim, where)
        for fqn in matched:
            _check_possible(fqn, parameters[fqn].shape, full, mesh_shape)
            resolved_parameters[fqn] = ResolvedSharding(
                _replicate_dims_too_small(fqn, parameters[fqn].shape, full, mesh_shape), pattern
            )
    apply_head_layouts(
        tuple(heads), resolved_parameters, list(parameters), mesh_shape=mesh_shape, mesh_dim=mesh_dim
    )
    _check_tied(parameters, resolved_parameters)

    module_fqns = [fqn for fqn, _ in module.named_modules(remove_duplicate=False)]
    by_suffix: dict[str, dict[str, tuple[ForwardPlacements, str]]] = {"input": {}, "output": {}}
    for pattern, suffix, forward_placements in forward:
        regex = compiled_pattern(pattern)
        matched = [fqn for fqn in module_fqns if regex.fullmatch(fqn)]
        key = f"{pattern}.{suffix}" if pattern else suffix
        if not matched:
            raise ShardingPlanError(no_match_message("forward", key, pattern, "module", module_fqns))
        forward_full = _forward_on_full_mesh(forward_placements, mesh_shape, mesh_dim, f"forward['{key}']")
        for fqn in matched:
            by_suffix[suffix][fqn] = (forward_full, pattern)
    return ResolvedShardingPlan(
        parameters=resolved_parameters, inputs=by_suffix["input"], outputs=by_suffix["output"]
    )
