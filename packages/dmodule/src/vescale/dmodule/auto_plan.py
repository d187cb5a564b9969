"""Automatic tensor/sequence-parallel plans, derived from what a model's forward does.

:func:`auto_sharding_plan` traces one forward (on meta parameters too; see
:mod:`vescale.dmodule._dataflow_trace`) and applies Megatron's rules to what it saw, never
to class or module names:

* a projection whose output features another projection consumes (through elementwise ops,
  head reshapes and attention, but no norm) is **column**-parallel: its output features are
  sharded (``InterleavedShard`` when its output is split into equal parts, as GPT-2's fused
  q|k|v or a fused gate|up); the consumer is **row**-parallel: its input features are
  sharded and its output is reduced (all-reduce, or reduce-scatter over the sequence with
  sequence parallelism). Heads stay whole: the plan notes the head counts a TP size must divide;
* embedding tables are sharded by rows (vocabulary parallel);
* a projection whose output goes to a log-softmax over its features (the LM head) is
  column-parallel with vocabulary-sharded logits: the loss runs on the shards;
* anything else (a router whose output feeds ``topk``, a projection nobody consumes) stays
  Replicate, and the result says which and why;
* with ``sequence_parallel=True`` activations between blocks are sharded on the sequence dim
  (dim 1): embedding outputs and row outputs reduce-scatter into it, column inputs gather it.

The plan's parameter and forward entries are sorted by pattern, the same in every process.

Example::

    result = plan_tensor_parallel(model, sequence_parallel=True)
    print(result.explain())
    parallelize_module(model, init_mesh(tp=4), result.plan)
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vescale.dmodule._dataflow_trace import DataflowTrace, Projection, trace_dataflow
from vescale.dmodule.errors import ShardingPlanError
from vescale.dmodule.example_labels import example_labels
from vescale.dmodule.sharding_plan import ShardingPlan

__all__ = ["AutoShardingResult", "auto_sharding_plan", "plan_tensor_parallel"]

logger = logging.getLogger("vescale.dmodule")


@dataclass(frozen=True)
class AutoShardingResult:
    """The automatic plan, why each projection got what it got, and the sizes TP must divide."""

    plan: ShardingPlan
    decisions: tuple[tuple[str, str], ...] = ()
    """``(parameter FQN, decision and reason)`` for every projection and embedding."""
    head_counts: tuple[int, ...] = ()
    """Query-head counts of the attentions: a TP size must divide each (key/value heads fewer
    than the TP size are replicated, see :mod:`vescale.dmodule._attention_heads`)."""

    def explain(self) -> str:
        """One line per decision, then the head-count constraint."""
        width = max((len(name) for name, _ in self.decisions), default=0)
        lines = [f"{name:<{width}}  {reason}" for name, reason in self.decisions]
        if self.head_counts:
            lines.append(f"tensor-parallel size must divide the head counts {sorted(set(self.head_counts))}")
        return "\n".join(lines)

    def check_tp_size(self, tp_size: int) -> None:
        """Raise ``ShardingPlanError`` if ``tp_size`` would split an attention head."""
        bad = sorted({heads for heads in self.head_counts if heads % tp_size})
        if bad:
            raise ShardingPlanError(
                f"a tensor-parallel size of {tp_size} does not divide the head counts {bad}; choose a size "
                f"that divides {sorted(set(self.head_counts))}"
            )


def _compact(entries: Mapping[str, object]) -> dict[str, object]:
    """``{fqn: value}`` as ``{pattern: value}``, one pattern for every layer where the value agrees."""
    by_pattern: dict[str, dict[str, object]] = {}
    for fqn, value in entries.items():
        pattern = re.sub(r"(?<=\\\.)\d+(?=\\\.)|^\d+(?=\\\.)", r"\\d+", re.escape(fqn))
        by_pattern.setdefault(pattern, {})[fqn] = value
    compact: dict[str, object] = {}
    for pattern, members in by_pattern.items():
        values = list(members.values())
        if all(value == values[0] for value in values):
            compact[pattern] = values[0]
        else:
            compact.update({re.escape(fqn): value for fqn, value in members.items()})
    return compact


def _module_of(parameter_fqn: str) -> str:
    return parameter_fqn.rpartition(".")[0]


def _default_example(model: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    # Distinct batch and sequence sizes, so that no dim is mistaken for the other.
    input_ids = torch.zeros(2, 8, dtype=torch.long, device=device)
    names = list(inspect.signature(model.forward).parameters)
    if "input_ids" in names and "labels" in names:
        return (), {"input_ids": input_ids, "labels": example_labels(model, input_ids)}
    positional = [name for name in names if name not in ("args", "kwargs")]
    return ((input_ids, input_ids) if len(positional) >= 2 else (input_ids,)), {}


def _column(projection: Projection, parameter: str, split_parts: int) -> str:
    dim = projection.out_dim if parameter == projection.weight else 0
    return f"IS({dim},{split_parts})" if split_parts > 1 else f"S({dim})"


def _fused_parts(projection: Projection) -> tuple[int, str]:
    """How many equal fused parts the projection's output is cut into, or 0 and why it cannot be split."""
    if projection.split_parts > 1 and projection.feature_size % projection.split_parts:
        return 0, (
            f"its {projection.feature_size} output features are split into {projection.split_parts} "
            "parts of unequal size, which InterleavedShard cannot shard"
        )
    if projection.split_parts > 1 or not projection.slices:
        return projection.split_parts, ""
    cuts = sorted(projection.slices)
    sizes = [end - start for start, end in cuts]
    tiles = cuts[0][0] == 0 and cuts[-1][1] == projection.feature_size
    tiles = tiles and all(cuts[i][1] == cuts[i + 1][0] for i in range(len(cuts) - 1))
    if not tiles:
        return 1, ""
    if len(set(sizes)) == 1:
        return len(cuts), ""
    return 0, f"its output is cut into unequal fused parts {sizes}, which InterleavedShard cannot shard"


@dataclass
class _Decisions:
    """What :func:`_decide` chose: placements by parameter FQN, why, and the sharded roles."""

    placements: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    columns: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    lm_heads: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)

    def replicate(self, names: set[str], why: str) -> None:
        """Take ``names`` out of every sharded role, with ``why`` as their reason."""
        for name in names:
            self.placements.pop(name, None)
            self.reasons[name] = f"replicated: {why}"
        for role in (self.columns, self.rows, self.lm_heads, self.embeddings):
            role[:] = [name for name in role if name not in names]


def _decide(trace: DataflowTrace) -> _Decisions:
    """Parameter placements, the reasons, and which parameters are columns, rows, heads, embeddings."""
    decided = _Decisions()
    placements, decisions = decided.placements, decided.reasons
    columns, rows, lm_heads = decided.columns, decided.rows, decided.lm_heads
    projections = trace.projections
    consumed_by: dict[str, list[str]] = {}
    for name, projection in projections.items():
        for producer_name in sorted(projection.consumes):
            consumed_by.setdefault(producer_name, []).append(name)
    for name, projection in projections.items():
        producers = [projections[p] for p in sorted(projection.consumes) if p in projections]
        if not producers:
            continue
        blocked = [p.weight for p in producers if p.routing or p.consumes]
        unequal = [reason for p in producers if (reason := _fused_parts(p)[1])]
        unequal += [
            f"{p.weight}'s output reaches {p.opaque}, which no plan shards" for p in producers if p.opaque
        ]
        if blocked or projection.routing or unequal:
            why = unequal[0] if unequal else f"{name} consumes {blocked or [name]}, which cannot be split"
            for member in [name, *(p.weight for p in producers)]:
                decisions[member] = f"replicated: {why}"
            continue
        rows.append(name)
        placements[name] = f"S({projection.in_dim})"
        decisions[name] = f"row-parallel S({projection.in_dim}): consumes {sorted(projection.consumes)}"
        for producer in producers:
            columns.append(producer.weight)
            split_parts = _fused_parts(producer)[0]
            placements[producer.weight] = _column(producer, producer.weight, split_parts)
            if producer.bias:
                placements[producer.bias] = _column(producer, producer.bias, split_parts)
            parts = f", {split_parts} fused parts" if split_parts > 1 else ""
            decisions[producer.weight] = f"column-parallel {placements[producer.weight]}: feeds {name}{parts}"
    for name, projection in projections.items():
        if name in placements or name in decisions:
            continue
        if projection.log_softmax and not projection.routing and name not in consumed_by:
            lm_heads.append(name)
            placements[name] = f"S({projection.out_dim})"
            decisions[name] = "column-parallel, vocabulary-sharded logits: its output goes to a log-softmax"
        elif projection.routing:
            decisions[name] = "replicated: its output feeds routing (topk/argmax), which needs all of it"
        else:
            decisions[name] = "replicated: no projection consumes its output, so no column/row pair"
    for embedding, why in sorted(trace.opaque_embeddings.items()):
        decisions[embedding] = f"replicated: {why}"
    for embedding in sorted(trace.embeddings):
        decided.embeddings.append(embedding)
        placements[embedding] = "S(0)"
        decisions[embedding] = "vocabulary-parallel S(0): an embedding table, sharded by rows"
    _tie(decided, trace, consumed_by)
    return decided


def _tie(decided: _Decisions, trace: DataflowTrace, consumed_by: dict[str, list[str]]) -> None:
    """Give every FQN of a tied parameter one placement.

    Tied input and output embeddings agree by themselves: the vocabulary-parallel table and the
    vocabulary-sharded head both shard the vocabulary dim (``S(0)`` of the ``(vocab, hidden)``
    weight). Where the uses of a tied tensor would want different placements, every use is
    replicated, together with the column/row partners of any use that was a projection pair
    (a row-parallel partner would otherwise read features no longer sharded).
    """
    for group in trace.tied:
        chosen = {decided.placements.get(name) for name in group}
        if len(chosen) == 1:
            continue
        names = set(group)
        for name in group:
            names.update(consumed_by.get(name, ()))
            if name in decided.rows:
                names.update(trace.projections[name].consumes)
        for name in list(names):
            projection = trace.projections.get(name)
            if projection is not None and projection.bias:
                names.add(projection.bias)
        described = ", ".join(f"{name}: {decided.placements.get(name, 'R')}" for name in group)
        decided.replicate(names, f"one tied tensor whose uses want different placements ({described})")


def plan_tensor_parallel(
    model: nn.Module,
    *,
    sequence_parallel: bool = False,
    example_args: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> AutoShardingResult:
    """The automatic plan of ``model`` with the reasons behind it (see the module docstring).

    Example::

        result = plan_tensor_parallel(model)
        result.check_tp_size(4); print(result.explain())
    """
    if example_args is None and example_kwargs is None:
        example_args, example_kwargs = _default_example(model)
    trace = trace_dataflow(model, example_args or (), example_kwargs or {})
    decided = _decide(trace)
    placements, decisions = decided.placements, decided.reasons
    columns, rows, lm_heads = decided.columns, decided.rows, decided.lm_heads
    residual = "S(1)" if sequence_parallel else "R"
    forward: dict[str, object] = {}
    for embedding in decided.embeddings:
        three_dims = trace.output_ndims.get(_module_of(embedding)) == 3
        forward[f"{_module_of(embedding)}.output"] = [residual if three_dims else "R"]
    for column in columns:
        forward.setdefault(f"{_module_of(column)}.input", _column_module_inputs(model, _module_of(column)))
    if sequence_parallel:
        # A replicated projection reads whole sequences too: fed the sequence-sharded residual,
        # its output would carry the sequence sharding into attention (OLMo2's q/k projections,
        # replicated because a norm spans all their heads, failed in attention's reshape).
        for name in trace.projections:
            if name not in placements and name not in rows:
                forward.setdefault(
                    f"{_module_of(name)}.input", _column_module_inputs(model, _module_of(name))
                )
        for key, value in _sequence_convolution_gathers(model, trace).items():
            forward.setdefault(key, value)
    for row in rows:
        # Only (batch, sequence, hidden) outputs can be sharded on the sequence; flattened tokens are reduced.
        three_dims = trace.output_ndims.get(_module_of(row)) == 3
        forward[f"{_module_of(row)}.output"] = [residual if three_dims else "R"]
        if sequence_parallel and not three_dims:
            forward.update(_token_block_gather(trace, _module_of(row)))
    for head in lm_heads:
        forward[f"{_module_of(head)}.input"] = ["R"]
        forward[f"{_module_of(head)}.output"] = ["S(-1)"]
    head_layouts = _head_layouts(trace, decided)
    plan = ShardingPlan.from_dict(
        {
            # Sorted, so that every process builds an equal plan: the trace records consumers in
            # sets. The patterns never overlap, so their order decides no placement.
            "parameter": dict(sorted(_compact(placements).items())),
            "forward": dict(sorted(_compact_forward(forward).items())),
            "heads": dict(sorted(_compact(head_layouts).items())),
        }
    )
    head_counts = tuple(sorted({layout[1] for layout in head_layouts.values()}))
    replicated = [name for name, reason in decisions.items() if reason.startswith("replicated")]
    if replicated:
        logger.info("auto_sharding_plan leaves %d projections replicated: %s", len(replicated), replicated)
    return AutoShardingResult(plan=plan, decisions=tuple(sorted(decisions.items())), head_counts=head_counts)


def _head_layouts(trace: DataflowTrace, decided: _Decisions) -> dict[str, list[int]]:
    """``[heads, query heads]`` for each column-parallel attention parameter (weight and bias).

    The query heads of an attention are the most heads among the columns its row projection
    consumes; key/value projections with fewer (grouped-query attention) are replicated by the
    plan's resolution when the tensor-parallel size exceeds their count.
    """
    layouts: dict[str, list[int]] = {}
    for row in decided.rows:
        producers = [trace.projections[name] for name in sorted(trace.projections[row].consumes)]
        headed = [(p, p.heads) for p in producers if p.heads and p.weight in decided.columns]
        if not headed:
            continue
        query_heads = max(heads for _, heads in headed)
        if query_heads == 1:
            continue  # one head in every projection: no attention's query heads to keep whole
        for producer, heads in headed:
            for name in (producer.weight, producer.bias):
                if name is not None and name in decided.placements:
                    layouts[name] = [heads, query_heads]
    return layouts


def _token_block_gather(trace: DataflowTrace, module_fqn: str) -> dict[str, list[str]]:
    """Under sequence parallelism, gather the sequence at the input of the nearest enclosing module
    with (batch, sequence, hidden) output, for a row module that sees flattened tokens.

    A fused-experts module (Mixtral) flattens the sequence-sharded tokens before routing them;
    run on those shards, its routing-weight gradients came out wrong (dp2 x tp2 + SP: every
    gradient below the first MoE block off by O(1)), while gathering the tokens at the MoE
    block's input gives the single-device gradients, as Megatron gathers before its router.
    """
    parts = module_fqn.split(".")
    for end in range(len(parts) - 1, 0, -1):
        ancestor = ".".join(parts[:end])
        if trace.output_ndims.get(ancestor) == 3:
            return {f"{ancestor}.input": ["R"]}
    return {}


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _sequence_convolution_gathers(model: nn.Module, trace: DataflowTrace) -> dict[str, list[str]]:
    """Under sequence parallelism, gather the whole sequence at the input of the nearest module
    around each convolution that takes (batch, sequence, hidden): a convolution mixes
    neighbouring positions, which a rank holding part of the sequence does not have.

    Inkling's short convolution on the residual stream (``mlp_sconv``) ran on each rank's part
    of the sequence: its causal padding made the parts' lengths disagree on one rank only,
    which raised while the other rank waited in the next collective.
    """
    gathers: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, _CONVOLUTIONS):
            continue
        parts = name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            ancestor = ".".join(parts[:end])
            if trace.output_ndims.get(ancestor) == 3:
                gathers[f"{ancestor}.input"] = _column_module_inputs(model, ancestor)
                break
    return gathers


def _column_module_inputs(model: nn.Module, module_fqn: str) -> list[str]:
    """``"R"`` for each positional input of the module holding a column-parallel weight.

    The gradient of every tensor entering that module comes back Partial over tp (each rank holds
    its shard's share), and the input conversion's backward reduces it at the module's boundary
    (Megatron's f). An undeclared input (a fused-experts module's routing weights, its third
    input) would carry the Partial gradient into replicated code, where DTensor may resolve it by
    sharding the dp mesh dim as well, mixing the dp ranks' different batches (Mixtral's router
    gradients under dp2 x tp2 were those of other ranks' tokens). Non-tensor inputs are left as
    they are by the conversion.
    """
    try:
        parameters = inspect.signature(model.get_submodule(module_fqn).forward).parameters.values()
    except (TypeError, ValueError):
        return ["R"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return ["R"] * max(1, sum(parameter.kind in positional for parameter in parameters))


def _compact_forward(forward: dict[str, object]) -> dict[str, object]:
    by_module: dict[str, dict[str, object]] = {key.rpartition(".")[0]: {} for key in forward}
    for key, value in forward.items():
        module, _, suffix = key.rpartition(".")
        by_module[module][suffix] = value
    compact = {}
    for suffix in ("input", "output"):
        entries = {module: entries[suffix] for module, entries in by_module.items() if suffix in entries}
        for pattern, value in _compact(entries).items():
            compact[f"{pattern}.{suffix}"] = value
    return compact


def auto_sharding_plan(model: nn.Module, *, sequence_parallel: bool = False) -> ShardingPlan:
    """A tensor-parallel plan for ``model`` from its structure (see :func:`plan_tensor_parallel`).

    Example::

        plan = auto_sharding_plan(model, sequence_parallel=True)
        parallelize_module(model, init_mesh(tp=2), plan)
    """
    return plan_tensor_parallel(model, sequence_parallel=sequence_parallel).plan
