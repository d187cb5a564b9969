"""The ``heads`` section of a sharding plan: attention heads that tensor parallelism must keep whole.

A column-parallel attention projection shards its output features, which are heads of
``head_dim`` features each. The plan's ``heads`` entry for such a parameter says how many heads
its sharded dim holds and how many query heads its attention has, ``[heads, query_heads]``
(``[2, 8]`` for the key projection of an 8-query, 2-key/value-head attention). Resolving the
plan for a tensor-parallel size ``tp``:

* ``query_heads % tp != 0``: no layout keeps every query head whole on one rank; the plan is
  refused before anything is applied, naming the module and the sizes that work;
* ``heads % tp == 0``: the parameter is sharded as its entry says (whole heads per rank);
* otherwise (fewer key/value heads than ranks, Megatron's case of TP beyond the KV-head count):
  the parameter is replicated over ``tp``. Each rank then computes every key/value head, and
  attention pairs its own query heads with the key/value heads they use; the gradient of a
  key/value head shared by several ranks' query heads comes back as a pending sum and is
  reduced like any replicated parameter's.

Example::

    layouts = parse_head_layouts({r"layers\\.\\d+\\.attn\\.k_proj\\.weight": [2, 8]})
    apply_head_layouts(layouts, resolved_parameters, list(parameter_fqns), mesh_shape=(4,), mesh_dim=0)
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.tensor import Replicate

from vescale.dmodule._plan_fqns import compiled_pattern, no_match_message
from vescale.dmodule.errors import ShardingPlanError

__all__ = ["HeadLayout", "apply_head_layouts", "head_layouts_to_json", "parse_head_layouts", "tp_sizes_for"]


@dataclass(frozen=True)
class HeadLayout:
    """``heads`` whole heads in a parameter's sharded dim, of an attention with ``query_heads``."""

    heads: int
    query_heads: int


def parse_head_layouts(section: Mapping[str, Any]) -> tuple[tuple[str, HeadLayout], ...]:
    """``{pattern: [heads, query_heads]}`` as ``((pattern, HeadLayout), ...)``, checked.

    Example::

        parse_head_layouts({r"k_proj\\.weight": [2, 8]})   # (('k_proj\\\\.weight', HeadLayout(2, 8)),)
    """
    if not isinstance(section, Mapping):
        raise ShardingPlanError(
            f"plan['heads'] must be a dict of pattern -> [heads, query_heads], got {type(section).__name__}"
        )
    layouts = []
    for pattern, value in section.items():
        counts = list(value) if isinstance(value, list | tuple) else None
        if counts is None or len(counts) != 2 or not all(isinstance(c, int) and c > 0 for c in counts):
            raise ShardingPlanError(
                f"heads['{pattern}'] = {value!r}: give [heads, query_heads], two positive integers "
                "(e.g. [2, 8]: a key projection holding 2 key/value heads of an attention with 8 query heads)"
            )
        compiled_pattern(str(pattern))
        layouts.append((str(pattern), HeadLayout(counts[0], counts[1])))
    return tuple(layouts)


def head_layouts_to_json(layouts: tuple[tuple[str, HeadLayout], ...]) -> dict[str, list[int]]:
    """The JSON form that :func:`parse_head_layouts` reads back equal."""
    return {pattern: [layout.heads, layout.query_heads] for pattern, layout in layouts}


def tp_sizes_for(query_heads: int, limit: int) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that keep ``query_heads`` whole per rank.

    Example::

        assert tp_sizes_for(12, 8) == [1, 2, 3, 4, 6]
    """
    return [size for size in range(1, limit + 1) if query_heads % size == 0]


def apply_head_layouts(
    layouts: tuple[tuple[str, HeadLayout], ...],
    resolved: MutableMapping[str, Any],
    parameter_fqns: list[str],
    *,
    mesh_shape: tuple[int, ...],
    mesh_dim: int,
) -> None:
    """Replicate over ``mesh_dim`` the resolved parameters whose heads that dim cannot split.

    ``resolved`` maps parameter FQNs to :class:`~vescale.dmodule._plan_resolution.ResolvedSharding`;
    entries are replaced, never half-changed: every layout is checked before any replacement.
    """
    tp = mesh_shape[mesh_dim]
    replicate: list[str] = []
    for pattern, layout in layouts:
        regex = compiled_pattern(pattern)
        matched = [fqn for fqn in parameter_fqns if regex.fullmatch(fqn)]
        if not matched:
            raise ShardingPlanError(no_match_message("heads", pattern, pattern, "parameter", parameter_fqns))
        for fqn in (fqn for fqn in matched if fqn in resolved):
            if layout.query_heads % tp:
                module = fqn.rpartition(".")[0]
                sizes = tp_sizes_for(layout.query_heads, max(tp, layout.query_heads))
                largest = max(size for size in sizes if size <= tp)
                raise ShardingPlanError(
                    f"module {module!r}: its attention has {layout.query_heads} query heads, which a "
                    f"tensor-parallel size of {tp} (mesh dim {mesh_dim}) would split; the largest size up "
                    f"to {tp} that keeps heads whole is {largest} (all that work: {sizes})"
                )
            if layout.heads % tp:
                replicate.append(fqn)
    for fqn in replicate:
        placements = list(resolved[fqn].placements)
        placements[mesh_dim] = Replicate()
        resolved[fqn] = replace(resolved[fqn], placements=tuple(placements))
