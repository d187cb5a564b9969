"""Trace one forward at the aten level and follow each projection's output features.

Every matmul whose weight is a parameter (``mm``/``addmm``/``bmm``/``_grouped_mm`` on a
view of a parameter: GPT-2's ``Conv1D`` and fused expert weights included) is a *projection*.
Each tensor carries ``features``: for each projection whose output features it still holds
intact, where they lie: a tensor dim and, within it, the stride range ``[lo, hi)`` they span
(a head split puts them on the heads dim; attention's batch×heads merge puts them inside the
merged dim, and the split back finds them again). Elementwise ops, views (head splits, merges),
transposes, attention and per-head reductions keep them; a reduction over a projection's
feature dim removes them and tags the result as a *normaliser* of those projections, and
an elementwise op that meets such a normaliser (``x * rsqrt(mean(x²))``: RMSNorm, LayerNorm)
removes them too. A projection that contracts over another's feature dim *consumes* it:
that pair is Megatron's column → row pair. Ops that need whole features (``topk``,
``argmax``, ``sort``) mark the projections they read as routing.

Example::

    trace = trace_dataflow(model, example_args=(input_ids,), example_kwargs={"labels": input_ids})
    trace.projections["model.layers.0.self_attn.o_proj.weight"].consumes   # {q, k, v weights}
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from vescale.dmodule.errors import ShardingPlanError
from vescale.dtensor import _compat
from vescale.dtensor.deferred.fake_values import FakeValuePolicy
from vescale.dtensor.model_state import model_state_kept

__all__ = ["DataflowTrace", "Projection", "trace_dataflow"]

aten = torch.ops.aten

_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten._grouped_mm.default}
_ROUTING = {aten.topk.default, aten.argmax.default, aten.sort.default, aten.max.dim, aten.argsort.default}
_LOG_SOFTMAX = {aten._log_softmax.default, aten._softmax.default, aten._safe_softmax.default}
_NORMS = {aten.native_layer_norm.default, aten._fused_rms_norm.default}
_PARAMETER_VIEWS = {
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.select.int,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    aten.index.Tensor,
    aten.alias.default,
    aten.detach.default,
    aten.slice.Tensor,
    aten._to_copy.default,
    aten.clone.default,
}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_PERMUTES = {aten.transpose.int, aten.permute.default, aten.t.default}
# Their index arguments are addresses: the output holds the source's values only.
_GATHERS = {aten.index.Tensor, aten.gather.default, aten.index_select.default, aten.take_along_dim.default}
_REDUCTIONS = {"mean", "sum", "var", "std", "amax", "amin", "norm", "logsumexp"}
# Ops whose arguments describe the features' layout (a convolution's ``groups`` counts the
# channels): run on a feature shard, they would compute with the whole tensor's arguments.
_OPAQUE = {aten.convolution.default, aten._convolution.default, aten.conv1d.default, aten.conv2d.default}


@dataclass
class Projection:
    """A parameter used as a matmul weight: which of its dims are the input and output features."""

    weight: str
    in_dim: int
    out_dim: int
    bias: str | None = None
    consumes: set[str] = field(default_factory=set)
    split_parts: int = 1
    slices: set[tuple[int, int]] = field(default_factory=set)
    """``(start, end)`` of each slice taken of the whole output features (a fused q|k|v cut by slicing)."""
    feature_size: int = 0
    heads: int | None = None
    routing: bool = False
    log_softmax: bool = False
    opaque: str = ""
    """An op its output features reach that mixes or indexes them in a way no plan models
    (a depthwise convolution's groups), by name; such a projection stays whole."""


@dataclass
class DataflowTrace:
    """What one traced forward showed (see the module docstring)."""

    projections: dict[str, Projection] = field(default_factory=dict)
    embeddings: set[str] = field(default_factory=set)
    output_ndims: dict[str, int] = field(default_factory=dict)
    """The number of dims of each module's output (when it is one tensor), by module FQN."""
    opaque_embeddings: dict[str, str] = field(default_factory=dict)
    """Embedding tables looked up where a vocabulary-parallel table cannot be, with the reason."""
    tied: list[tuple[str, ...]] = field(default_factory=list)
    """The FQNs of each parameter that has several (tied input and output embeddings)."""


@dataclass(frozen=True)
class _ParameterView:
    name: str
    dims: tuple[int | None, ...]  # for each dim of the view, the parameter dim it is (None: new)


Location = tuple[int, int, int]
"""``(dim, lo, hi)``: the features lie in tensor dim ``dim``, spanning its strides ``[lo, hi)``."""


@dataclass
class _Flow:
    features: dict[str, Location] = field(default_factory=dict)
    normalises: frozenset[str] = frozenset()


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _moved(location: Location, dim: int) -> Location:
    return (dim, location[1], location[2])


def _reshape_groups(before: Sequence[int], after: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The input and output dims of a reshape that hold the same elements, group by group."""
    groups, i, j = [], 0, 0
    while i < len(before) and j < len(after):
        dims_in, dims_out = [i], [j]
        size_in, size_out = before[i], after[j]
        while size_in != size_out:
            if size_in < size_out:
                i += 1
                dims_in.append(i)
                size_in *= before[i]
            else:
                j += 1
                dims_out.append(j)
                size_out *= after[j]
        groups.append((dims_in, dims_out))
        i, j = i + 1, j + 1
    return groups


def _strides_within(dims: list[int], shape: Sequence[int]) -> dict[int, int]:
    strides, step = {}, 1
    for dim in reversed(dims):
        strides[dim] = step
        step *= shape[dim]
    return strides


def _reshaped(location: Location, before: Sequence[int], after: Sequence[int]) -> Location | None:
    """Where features at ``location`` lie after a reshape: their outermost part's dim and span."""
    dim, lo, hi = location
    for dims_in, dims_out in _reshape_groups(before, after):
        if dim not in dims_in:
            continue
        step = _strides_within(dims_in, before)[dim]
        low, high = lo * step, hi * step
        out_strides = _strides_within(dims_out, after)
        for out_dim in dims_out:  # outermost first
            stride = out_strides[out_dim]
            if stride < high and stride * after[out_dim] > low:
                return (out_dim, max(low, stride) // stride, min(high, stride * after[out_dim]) // stride)
    return None


def _splits_one_head(at: Location, moved: Location, before: Sequence[int], after: Sequence[int]) -> bool:
    """Whether a reshape turned whole features ``(..., F)`` into one head ``(..., 1, F)``.

    ``view(batch, seq, -1, head_dim)`` of a projection with a single key/value head (multi-query
    attention: Seed-OSS, Falcon) adds a heads dim of size 1; without counting it, the projection
    looked head-less and rotary's halves of that one head looked like fused parts.
    """
    whole_before = at[1] == 1 and at[2] == before[at[0]]
    whole_after = moved[1] == 1 and moved[2] == after[moved[0]]
    return (
        whole_before
        and whole_after
        and len(after) == len(before) + 1
        and moved[0] >= 1
        and after[moved[0] - 1] == 1
        and after[moved[0]] == before[at[0]]
    )


if TYPE_CHECKING:
    from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
else:
    _DispatchModeBase = _compat.torch_dispatch_mode_class()


class _Tracer(_DispatchModeBase):
    def __init__(self, parameters: dict[int, list[str]], modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.parameter_names = parameters
        self.modules = modules
        self.failed_in: str | None = None
        self.module_stack: list[str] = []
        """FQNs of the modules whose forward is running, outermost first."""
        self.views: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.flows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.trace = DataflowTrace()

    # --- bookkeeping -----------------------------------------------------------------
    def _parameter_name(self, tensor: Any) -> str | None:
        """The FQN under which the running module uses ``tensor``, for a parameter.

        A tied parameter has several FQNs (GPT-2's ``transformer.wte.weight`` is also
        ``lm_head.weight``); the one owned by the innermost running module names this use, so
        the embedding lookup is recorded as the embedding and the head's matmul as the head.
        """
        aliases = self.parameter_names.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if not aliases:
            return None
        for module_fqn in reversed(self.module_stack):
            for alias in aliases:
                if alias.rpartition(".")[0] == module_fqn:
                    return alias
        return aliases[0]

    def _opaque_lookup(self, name: str) -> str:
        """Why a lookup of table ``name`` cannot be vocabulary-parallel ("" when it can).

        A vocabulary-parallel lookup returns per-rank partial rows, made whole by the owning
        module's output conversion. Only a plain ``nn.Embedding`` returns the lookup as it is;
        a module that computes on it first (Inkling's normed embedding, CPM-Ant's position
        bias) would compute on partial rows.
        """
        owner_fqn = name.rpartition(".")[0]
        owner = self.modules.get(owner_fqn)
        running = self.module_stack[-1] if self.module_stack else None
        if not isinstance(owner, nn.Embedding) or type(owner).forward is not nn.Embedding.forward:
            kind = type(owner).__name__ if owner is not None else "no module"
            return (
                f"its lookup runs inside {owner_fqn or '<root>'} ({kind}), which is not a plain nn.Embedding"
            )
        if running != owner_fqn:
            return f"it is looked up outside its own module's forward (in {running or '<root>'})"
        return ""

    def _view_of(self, tensor: Any) -> _ParameterView | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        name = self._parameter_name(tensor)
        if name is not None:
            return _ParameterView(name, tuple(range(tensor.ndim)))
        # torch leaves WeakTensorKeyDictionary.get unannotated.
        view: _ParameterView | None = self.views.get(tensor)  # type: ignore[no-untyped-call]
        return view

    def _flow(self, tensor: Any) -> _Flow:
        if not isinstance(tensor, torch.Tensor):
            return _Flow()
        flow: _Flow = self.flows.get(tensor, _Flow())  # type: ignore[no-untyped-call]  # as above
        return flow

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:
            output = self._run(func, args, kwargs)
        except Exception:
            # The module running when an op last failed: earlier refusals (a scalar read) may have
            # been answered by FakeValuePolicy above this mode; the last one is the one that ends the trace.
            self.failed_in = self.module_stack[-1] if self.module_stack else "<root>"
            raise
        # An op this trace cannot model (odd argument forms) carries no feature information forward.
        with contextlib.suppress(IndexError, KeyError, ValueError, ZeroDivisionError):
            self._record(func, args, kwargs, output)
        return output

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
        if meta and func is aten._grouped_mm.default:
            mat_a, mat_b = args[0], args[1]
            rows = mat_a.shape[0] if mat_a.ndim == 2 else mat_a.shape[1]
            shape = (rows, mat_b.shape[-1]) if mat_a.ndim == 2 else (mat_a.shape[0], rows, mat_b.shape[-1])
            return torch.empty(shape, dtype=mat_a.dtype, device="meta")
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        source = args[0] if args else None
        if func is aten.embedding.default:
            name = self._parameter_name(source) or ""
            why = self._opaque_lookup(name)
            if why:
                self.trace.opaque_embeddings[name] = why
            else:
                self.trace.embeddings.add(name)
            return
        if func in _MATMULS:
            self._record_matmul(func, args, output)
            return
        view = self._view_of(source)
        if view is not None and func in _PARAMETER_VIEWS and isinstance(output, torch.Tensor):
            self._record_parameter_view(func, args, view, output)
            return
        self._propagate(func, args, kwargs, output)

    def _record_parameter_view(
        self, func: Any, args: tuple[Any, ...], view: _ParameterView, output: torch.Tensor
    ) -> None:
        dims = list(view.dims)
        if func in (aten.t.default, aten.transpose.int):
            a, b = (
                (0, 1)
                if func is aten.t.default
                else (_norm_dim(args[1], len(dims)), _norm_dim(args[2], len(dims)))
            )
            dims[a], dims[b] = dims[b], dims[a]
        elif func is aten.permute.default:
            dims = [dims[d] for d in args[1]]
        elif func in (aten.select.int, aten.squeeze.dim):
            del dims[_norm_dim(args[1], len(dims))]
        elif func is aten.unsqueeze.default:
            dims.insert(_norm_dim(args[1], len(dims) + 1), None)
        elif func is aten.index.Tensor and output.ndim == len(dims) - 1:
            del dims[0]  # weight[expert]: an integer tensor indexing the leading (expert) dim
        elif output.ndim != len(dims):
            return
        self.views[output] = _ParameterView(view.name, tuple(dims))

    def _projection(self, view: _ParameterView, contraction_dim: int, output_dim: int) -> Projection | None:
        in_dim, out_dim = view.dims[contraction_dim], view.dims[output_dim]
        if in_dim is None or out_dim is None:
            return None
        projection = self.trace.projections.get(view.name)
        if projection is None:
            projection = self.trace.projections[view.name] = Projection(view.name, in_dim, out_dim)
        return projection

    def _record_matmul(self, func: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if func is aten.addmm.default:
            bias, activation, weight = args[0], args[1], args[2]
        else:
            bias, activation, weight = None, args[0], args[1]
        view = self._view_of(weight)
        flow = self._flow(activation)
        if view is None:
            self._propagate_activation_matmul(activation, weight, output)
            return
        projection = self._projection(view, weight.ndim - 2, weight.ndim - 1)
        if projection is None:
            return
        bias_view = self._view_of(bias)
        if bias_view is not None:
            projection.bias = bias_view.name
        contraction = activation.ndim - 1
        projection.consumes |= {name for name, at in flow.features.items() if at[0] == contraction}
        projection.feature_size = output.shape[-1]
        self.flows[output] = _Flow({projection.weight: (output.ndim - 1, 1, output.shape[-1])})

    def _propagate_activation_matmul(self, left: Any, right: Any, output: torch.Tensor) -> None:
        # Attention's q @ kᵀ and probs @ v: batch dims carry heads; the contraction mixes positions only.
        features = {}
        for operand, kept in (
            (left, range(left.ndim - 1)),
            (right, [*range(right.ndim - 2), right.ndim - 1]),
        ):
            for name, at in self._flow(operand).features.items():
                if at[0] in kept:
                    features[name] = at
        self.flows[output] = _Flow(features)

    def _propagate(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list | tuple) for t in a if isinstance(t, torch.Tensor)]
        if func in _GATHERS:
            tensors = tensors[:1]
        flows = [self._flow(tensor) for tensor in tensors]
        if not any(flow.features or flow.normalises for flow in flows):
            return
        if isinstance(output, torch.Tensor):
            outputs = [output]
        elif isinstance(output, list | tuple):
            outputs = [item for item in output if isinstance(item, torch.Tensor)]
        else:
            return  # a device, a size, a number: no features to carry
        first = tensors[0]
        if func in _OPAQUE:
            for flow in flows:
                for name in flow.features:
                    self.trace.projections[name].opaque = str(func)
            return
        if func in _ROUTING or func in _LOG_SOFTMAX:
            self._mark_whole_feature_readers(func, args, first)
        if func is aten.slice.Tensor:
            self._record_slice(args, first)
        if func in _NORMS:
            for out in outputs:
                self.flows[out] = _Flow()
        elif func in _SPLITS:
            self._record_split(args, first, outputs)
        elif func in _RESHAPES:
            self._record_reshape(first, outputs[0])
        elif func in _PERMUTES:
            self._record_permute(func, args, first, outputs[0])
        elif outputs:
            self._record_elementwise_or_reduction(func, args, kwargs, tensors, flows, outputs)

    def _mark_whole_feature_readers(self, func: Any, args: tuple[Any, ...], source: torch.Tensor) -> None:
        dim_argument = {aten.topk.default: 3}.get(func, 1)
        dim = args[dim_argument] if len(args) > dim_argument else -1
        dim = _norm_dim(dim if isinstance(dim, int) else -1, source.ndim)
        for name, (feature_dim, _, _) in self._flow(source).features.items():
            if feature_dim != dim and func in _LOG_SOFTMAX:
                continue  # attention's softmax runs over key positions, not over the heads it shards
            projection = self.trace.projections[name]
            projection.routing |= func in _ROUTING
            projection.log_softmax |= func in _LOG_SOFTMAX

    def _record_slice(self, args: tuple[Any, ...], source: torch.Tensor) -> None:
        dim = _norm_dim(args[1] if len(args) > 1 else 0, source.ndim)
        size = source.shape[dim]
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        end = args[3] if len(args) > 3 and args[3] is not None else size
        for name, (feature_dim, lo, hi) in self._flow(source).features.items():
            # Slices of a head (rotary's halves) are not fused parts: only the whole output is fused.
            if self.trace.projections[name].heads is not None:
                continue
            if feature_dim == dim and lo == 1 and hi == size:
                self.trace.projections[name].slices.add(
                    (max(start % size if start < 0 else start, 0), min(end, size))
                )

    def _record_elementwise_or_reduction(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[Any],
        flows: list[_Flow],
        outputs: list[Any],
    ) -> None:
        reduced = self._reduced_dims(func, args, tensors[0])
        keepdim = self._keepdim(args, kwargs)
        normalises = set().union(*(flow.normalises for flow in flows))
        features: dict[str, Location] = {}
        conflicting = set()
        out_ndim = outputs[0].ndim
        for index, (tensor, flow) in enumerate(zip(tensors, flows, strict=True)):
            for name, at in flow.features.items():
                dim = at[0]
                if reduced is not None and index == 0:
                    if dim in reduced:
                        normalises.add(name)  # the reduction mixed these features: x * rsqrt(mean(x²))
                        continue
                    aligned = _moved(at, dim if keepdim else dim - sum(1 for r in reduced if r < dim))
                else:
                    aligned = _moved(at, dim + out_ndim - tensor.ndim)  # broadcasting aligns from the right
                if features.setdefault(name, aligned) != aligned:
                    conflicting.add(name)
        features = {n: d for n, d in features.items() if n not in conflicting and n not in normalises}
        for out in outputs:
            self.flows[out] = _Flow(features, frozenset(normalises))

    def _reduced_dims(self, func: Any, args: tuple[Any, ...], first: torch.Tensor) -> set[int] | None:
        if func._schema.name.removeprefix("aten::") not in _REDUCTIONS:
            return None
        dims = args[1] if len(args) > 1 and args[1] is not None else list(range(first.ndim))
        dims = [dims] if isinstance(dims, int) else list(dims)
        return {_norm_dim(d, first.ndim) for d in dims} or set(range(first.ndim))

    @staticmethod
    def _keepdim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False))

    def _record_split(self, args: tuple[Any, ...], source: torch.Tensor, outputs: list[Any]) -> None:
        dim = _norm_dim(args[2] if len(args) > 2 else 0, source.ndim)
        flow = self._flow(source)
        for name, at in flow.features.items():
            projection = self.trace.projections[name]
            # A split after the head split cuts heads into groups (DiffLlama's two halves of its
            # value heads), not fused parts: only the whole output of a projection is fused.
            if projection.heads is not None:
                continue
            if at[0] == dim and len(outputs) > 1 and len({out.shape[dim] for out in outputs}) == 1:
                projection.split_parts = len(outputs)
        for out in outputs:
            features = {
                name: (at[0], at[1], min(at[2], out.shape[at[0]])) for name, at in flow.features.items()
            }
            self.flows[out] = _Flow(features, flow.normalises)

    def _record_reshape(self, source: torch.Tensor, output: torch.Tensor) -> None:
        flow = self._flow(source)
        features = {}
        for name, at in flow.features.items():
            moved = _reshaped(at, list(source.shape), list(output.shape))
            if moved is None:
                continue
            features[name] = moved
            # A projection's features split into (heads, head_dim): the outer part counts the heads.
            projection = self.trace.projections[name]
            if projection.heads is None and at[1] == 1 and moved[2] // moved[1] < at[2] // at[1]:
                projection.heads = moved[2] // moved[1]
            elif projection.heads is None and _splits_one_head(at, moved, source.shape, output.shape):
                projection.heads = 1
        self.flows[output] = _Flow(features, flow.normalises)

    def _record_permute(
        self, func: Any, args: tuple[Any, ...], source: torch.Tensor, output: torch.Tensor
    ) -> None:
        order = list(range(source.ndim))
        if func is aten.permute.default:
            order = [_norm_dim(d, source.ndim) for d in args[1]]
        else:
            a, b = (
                (0, 1)
                if func is aten.t.default
                else (_norm_dim(args[1], source.ndim), _norm_dim(args[2], source.ndim))
            )
            order[a], order[b] = order[b], order[a]
        flow = self._flow(source)
        features = {name: _moved(at, order.index(at[0])) for name, at in flow.features.items()}
        self.flows[output] = _Flow(features, flow.normalises)


def trace_dataflow(
    model: nn.Module, example_args: tuple[Any, ...] = (), example_kwargs: dict[str, Any] | None = None
) -> DataflowTrace:
    """Run ``model(*example_args, **example_kwargs)`` once under the tracer (no gradients).

    Works on meta parameters too: data-dependent ops are answered as if every branch were taken.

    Example::

        trace = trace_dataflow(model, (torch.zeros(3, 7, dtype=torch.long),))
    """
    parameters: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        parameters.setdefault(id(parameter), []).append(name)
    tracer = _Tracer(parameters, dict(model.named_modules()))
    trace = tracer.trace
    trace.tied = [tuple(names) for names in parameters.values() if len(names) > 1]

    def enter(fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            tracer.module_stack.append(fqn)

        return hook

    def leave(fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if tracer.module_stack and tracer.module_stack[-1] == fqn:
                tracer.module_stack.pop()
            if isinstance(output, torch.Tensor):
                trace.output_ndims[fqn] = output.ndim

        return hook

    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(fqn)))
        handles.append(module.register_forward_hook(leave(fqn), always_call=True))
    try:
        # FakeValuePolicy (inside the tracer): the values a deferred model's code reads (X-MOD's
        # boolean-mask token selection) are answered as a batch would, so its trace runs on.
        # Planning changes nothing a single-device run would do or draw next: the trace's random
        # ops (dropout) do not move the caller's generators, and what the forward changed in the
        # model (BigBird's attention swap, BatchNorm statistics) is undone.
        with torch.no_grad(), model_state_kept(model), tracer, FakeValuePolicy():
            model(*example_args, **(example_kwargs or {}))
    except Exception as error:
        running = tracer.failed_in or "<root>"
        raise ShardingPlanError(
            f"the automatic plan could not trace {type(model).__name__}'s forward on tensors without "
            f"data to recognise its modules: module '{running}' raised {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''} (a value it reads, such as per-expert "
            "token counts, has no stand-in); give the model a manual sharding plan instead"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    looked_up = trace.embeddings | set(trace.opaque_embeddings)
    trace.projections = {name: p for name, p in trace.projections.items() if name not in looked_up}
    return trace
