"""Where to cut an unmodified model into pipeline stages.

The model is seen as a sequence of *units* in execution order: the repeated blocks (the
longest ``nn.ModuleList`` of same-class modules) and every other module that owns parameters
outside the blocks (embeddings, final norm, head). A stage is a contiguous run of units; a
cut sits before a block or before a unit that runs after the blocks, where the hidden state
is the only value that flows on. A parameter of the module around the blocks (Zaya's input
scale and bias, XLNet's unused ``mask_emb``) belongs to the first stage when the forward uses
it only before the blocks (or not at all), to the last when only after them. Cuts are given
as module FQNs or chosen over the blocks: uniformly, or balancing parameter counts or FLOPs.

Example::

    layout = split_model(model, PipelinePlan(size=2), trace_model(model, default_example_batch(model)))
    assert layout.boundaries == ("model.layers.1",)
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from torch import nn

from vescale.dpipe.errors import PipelineCutError, PipelinePlanError, SplitPointError, StageCountError
from vescale.dpipe.plan import PipelinePlan
from vescale.dpipe.tracing import ModelTrace

__all__ = ["StageLayout", "find_blocks", "split_model"]


@dataclass(frozen=True)
class StageLayout:
    """The cut of a model: the module starting each stage after the first, and each unit's stage.

    ``loose_parameters`` maps each parameter of a module around the blocks to its stage.
    """

    boundaries: tuple[str, ...]
    unit_stage: dict[str, int]
    block_fqns: tuple[str, ...]
    loose_parameters: dict[str, int] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1

    def units_of(self, stage_index: int) -> list[str]:
        """The unit FQNs that ``stage_index`` owns, in execution order."""
        return [fqn for fqn, stage in self.unit_stage.items() if stage == stage_index]


def find_blocks(model: nn.Module, trace: ModelTrace | None = None) -> tuple[str, ...]:
    """The FQNs of the model's repeated blocks: the longest ``ModuleList`` of same-class modules.

    A hybrid model whose layers are of several classes (Jamba's Mamba and attention layers, in
    one list) has no such list of two or more: its longest ``ModuleList`` is taken instead. What a
    later stage needs besides the hidden state is found either way and sent along
    (:mod:`vescale.dpipe.stage_inputs`). Given the ``trace`` of a forward, only lists whose
    every member ran count: a multimodal model's vision or audio encoder (Phi-4's 24 conformer
    layers) does not run on a text batch, its language model's layers do.

    Example::

        assert find_blocks(llama)[0] == "model.layers.0"
        assert find_blocks(gemma3, trace)[0] == "model.language_model.layers.0"
    """
    same: tuple[str, ...] = ()
    mixed: tuple[str, ...] = ()
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        prefix = f"{fqn}." if fqn else ""
        members = tuple(f"{prefix}{index}" for index in range(len(module)))
        if trace is not None and not all(member in trace.call_index for member in members):
            continue
        if len({type(child) for child in module.children()}) == 1:
            same = members if len(members) > len(same) else same
        elif len(members) > len(mixed):
            mixed = members
    return same if len(same) >= 2 or not mixed else mixed


def split_model(model: nn.Module, plan: PipelinePlan, trace: ModelTrace) -> StageLayout:
    """Cut ``model`` into ``plan.num_stages`` stages as ``plan`` says; raise a typed error if it cannot.

    Example::

        layout = split_model(model, PipelinePlan(size=2, split_method="params"), trace)
        print(layout.units_of(0))
    """
    block_fqns = find_blocks(model, trace)
    _check_blocks_run_once(model, block_fqns, trace)
    units, loose = _units_in_order(model, block_fqns, trace)
    if plan.split_method == "manual":
        boundaries = tuple(plan.split_points)
    else:
        if not block_fqns:
            raise PipelineCutError(
                f"{type(model).__name__} has no nn.ModuleList of repeated blocks to split "
                f"'{plan.split_method}'; give split_method='manual' and split_points"
            )
        if plan.num_stages > len(block_fqns):
            raise StageCountError(
                f"PipelinePlan asks for {plan.num_stages} stages but {type(model).__name__} has only "
                f"{len(block_fqns)} blocks ({block_fqns[0]} .. {block_fqns[-1]}); lower size or "
                "virtual_stages"
            )
        if plan.split_method == "uniform":
            cuts = _uniform_cuts(len(block_fqns), plan.num_stages)
        else:
            cuts = _balanced_cuts(
                _block_costs(model, plan.split_method, block_fqns, units, trace), plan.num_stages
            )
        boundaries = tuple(block_fqns[index] for index in cuts)
    _check_boundaries(model, boundaries, block_fqns, units, trace)
    # A unit that never ran (Fuyu's image projection on a text batch) stays on stage 0.
    unit_stage = {
        unit: sum(trace.call_index[cut] <= trace.call_index.get(unit, -1) for cut in boundaries)
        for unit in units
    }
    last_stage = len(boundaries)
    loose_parameters = {name: 0 if before else last_stage for name, before in loose.items()}
    layout = StageLayout(boundaries, unit_stage, block_fqns, loose_parameters)
    for stage_index in range(layout.num_stages):
        if not layout.units_of(stage_index):
            raise StageCountError(
                f"stage {stage_index} would own no parameters with split points {list(boundaries)}; "
                "each stage needs at least one block or other module with parameters"
            )
    return layout


def _units_in_order(
    model: nn.Module, block_fqns: tuple[str, ...], trace: ModelTrace
) -> tuple[list[str], dict[str, bool]]:
    """The units in execution order, and the parameters of modules around the blocks: whether
    each is used before the blocks (or never), else after them."""
    blocks = set(block_fqns)
    units: list[str] = []
    loose: dict[str, bool] = {}
    for fqn, module in model.named_modules():
        if fqn in blocks:
            units.append(fqn)
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if any(_is_inside(fqn, unit) for unit in units):
            continue
        if fqn == "" or any(_is_inside(block, fqn) for block in block_fqns):
            loose.update(_loose_parameters(model, fqn, module, block_fqns, trace))
            continue
        units.append(fqn)
    # Modules that never ran (unused) go first: stage 0 keeps them and they receive no gradient.
    return sorted(units, key=lambda unit: trace.call_index.get(unit, -1)), loose


def _loose_parameters(
    model: nn.Module, fqn: str, module: nn.Module, block_fqns: tuple[str, ...], trace: ModelTrace
) -> dict[str, bool]:
    """``{parameter FQN: used before the blocks (or never)}`` of ``module``'s own parameters."""
    first = trace.call_index.get(block_fqns[0], -1) if block_fqns else -1
    last = trace.call_index.get(block_fqns[-1], -1) if block_fqns else -1
    placed: dict[str, bool] = {}
    for name, _ in module.named_parameters(recurse=False):
        full_name = f"{fqn}.{name}" if fqn else name
        span = trace.parameter_uses.get(full_name)
        if span is None or (block_fqns and span[1] < first):
            placed[full_name] = True
        elif block_fqns and span[0] >= last:
            placed[full_name] = False
        else:
            raise PipelineCutError(_own_parameters_message(model, fqn, module, block_fqns, trace))
    return placed


def _check_blocks_run_once(model: nn.Module, block_fqns: tuple[str, ...], trace: ModelTrace) -> None:
    for block in block_fqns:
        count = trace.call_counts.get(block, 1)
        if count > 1:
            raise PipelineCutError(
                f"{type(model).__name__} runs its block {block!r} {count} times in one forward (its "
                "blocks run in a loop, as in a recurrent model); a pipeline stage runs each of its "
                "blocks once per micro-batch and passes the hidden state on, so this model has no "
                "pipeline split: train it without pipeline parallelism"
            )


def _own_parameters_message(
    model: nn.Module, fqn: str, module: nn.Module, block_fqns: tuple[str, ...], trace: ModelTrace
) -> str:
    """Why ``module``'s own parameters have no stage: which they are and where the forward uses them."""
    first = trace.call_index.get(block_fqns[0], -1) if block_fqns else -1
    last = trace.call_index.get(block_fqns[-1], -1) if block_fqns else -1
    uses = []
    for name, _ in module.named_parameters(recurse=False):
        full_name = f"{fqn}.{name}" if fqn else name
        span = trace.parameter_uses.get(full_name)
        if span is None:
            where = "not used by this forward"
        elif block_fqns and span[1] < first:
            where = f"used before the first block {block_fqns[0]!r}"
        elif block_fqns and span[0] >= last:
            where = "used after the blocks"
        else:
            where = "used where the blocks run"
        uses.append(f"{full_name!r} ({where})")
    owner = repr(fqn) if fqn else "the model's root"
    blocks = f"holds the blocks {block_fqns[0]!r}.. and " if block_fqns else ""
    return (
        f"module {owner} ({type(module).__name__}) {blocks}has parameters of its own: "
        f"{', '.join(uses)}; dpipe gives such a parameter to the first stage when the forward uses "
        "it only before the blocks, to the last when only after them, so one used where the "
        "blocks run belongs to no stage. Move it into a submodule that runs before or after the "
        "blocks, or train without pipeline parallelism"
    )


def _is_inside(fqn: str, ancestor: str) -> bool:
    return ancestor == "" or fqn.startswith(f"{ancestor}.")


def _check_boundaries(
    model: nn.Module,
    boundaries: tuple[str, ...],
    block_fqns: tuple[str, ...],
    units: list[str],
    trace: ModelTrace,
) -> None:
    module_fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    last_block_index = trace.call_index.get(block_fqns[-1], -1) if block_fqns else -1
    for cut in boundaries:
        if cut not in module_fqns:
            closest = difflib.get_close_matches(cut, module_fqns, n=3, cutoff=0.5)
            raise SplitPointError(
                f"split point {cut!r} names no module of {type(model).__name__}; closest: {closest}"
            )
        if cut not in trace.call_index:
            children = [
                fqn for fqn in module_fqns if fqn.startswith(f"{cut}.") and "." not in fqn[len(cut) + 1 :]
            ]
            raise PipelineCutError(
                f"cannot cut before {cut!r}: it never runs in forward (a container is not called); "
                f"cut before one of its children, e.g. {children[:2]}"
            )
        function = trace.inside_autograd_function.get(cut)
        if function is not None:
            raise PipelineCutError(
                f"cannot cut before {cut!r}: it runs inside the forward of the custom autograd function "
                f"{function}, whose backward recomputes and differentiates what it ran as one piece (e.g. "
                "reversible layers), so the received hidden state would never reach it; keep the "
                "pipeline to one stage for this model"
            )
        enclosing = [unit for unit in units if _is_inside(cut, unit)]
        if enclosing:
            raise PipelineCutError(
                f"cannot cut before {cut!r}: it runs inside {enclosing[0]!r}, whose other values (e.g. a "
                f"residual stream) would not reach the next stage; cut before {enclosing[0]!r} or the "
                "unit after it"
            )
        inner = [unit for unit in units if _is_inside(unit, cut)]
        is_block = cut in block_fqns
        if not is_block and (inner or trace.call_index[cut] < last_block_index):
            raise PipelineCutError(
                f"cannot cut before {cut!r}: only the hidden state crosses a stage boundary, and at "
                f"{cut!r} it is not the module's only input; cut before a block (e.g. "
                f"{block_fqns[1:2] or block_fqns[:1]}) or before a module that runs after the blocks"
            )
    order = [trace.call_index[cut] for cut in boundaries]
    if order != sorted(set(order)):
        raise PipelinePlanError(f"split points {list(boundaries)} must be distinct and in execution order")


def _block_costs(
    model: nn.Module, method: str, block_fqns: tuple[str, ...], units: list[str], trace: ModelTrace
) -> list[float]:
    first, last = trace.call_index[block_fqns[0]], trace.call_index[block_fqns[-1]]
    if method == "params":
        counts = {unit: sum(p.numel() for p in model.get_submodule(unit).parameters()) for unit in units}
        costs = [float(counts[block]) for block in block_fqns]
        costs[0] += sum(count for unit, count in counts.items() if trace.call_index.get(unit, -1) < first)
        costs[-1] += sum(count for unit, count in counts.items() if trace.call_index.get(unit, -1) > last)
        return costs
    costs = [float(trace.forward_flops[block]) for block in block_fqns]
    # What runs before the first block (embeddings) and after the last (norm, head, loss).
    costs[0] += trace.flops_before[block_fqns[0]]
    costs[-1] += trace.total_flops - trace.flops_before[block_fqns[-1]] - trace.forward_flops[block_fqns[-1]]
    return costs


def _uniform_cuts(num_blocks: int, num_stages: int) -> list[int]:
    """Indices where stages 1.. start: equal block counts, the first stages take the remainder."""
    sizes = [num_blocks // num_stages + (stage < num_blocks % num_stages) for stage in range(num_stages)]
    return [sum(sizes[:stage]) for stage in range(1, num_stages)]


def _balanced_cuts(costs: list[float], num_stages: int) -> list[int]:
    """Indices where stages 1.. start, minimising the costliest stage (ties: earlier cuts)."""
    count = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = float("inf")
    # best[s][i]: the smallest possible maximum over s stages covering costs[:i]
    best = [[infinity] * (count + 1) for _ in range(num_stages + 1)]
    cut_at = [[0] * (count + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for stages in range(1, num_stages + 1):
        for end in range(stages, count + 1):
            for start in range(stages - 1, end):
                candidate = max(best[stages - 1][start], prefix[end] - prefix[start])
                if candidate < best[stages][end]:
                    best[stages][end], cut_at[stages][end] = candidate, start
    cuts, end = [], count
    for stages in range(num_stages, 0, -1):
        end = cut_at[stages][end]
        cuts.append(end)
    return sorted(cuts)[1:]
