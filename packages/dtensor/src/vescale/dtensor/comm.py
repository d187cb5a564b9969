"""Count the collectives a rank issues, by type and mesh dim, with the bytes it moves.

:class:`CommCounter` is a context manager that sees every collective below autograd: the
functional collectives DTensor's redistribution issues (``torch.ops._c10d_functional.*``,
with their ``wait_tensor``) and eager ``torch.distributed`` calls (``dist.all_reduce`` and
the rest reach the ``c10d`` ops). Each call is attributed to the counter mesh's dim whose
process group it ran on (by name when the mesh names its dims), else to ``"world"`` or
``"other"``; its bytes follow :func:`bytes_moved` (ring algorithm, per rank). Code that issues
collectives for one module labels them with :func:`comm_scope` (MoE all-to-alls: the experts
module's FQN and ``/dispatch`` or ``/combine``), and the counter sums them per label.

Example::

    with CommCounter(mesh) as counter:
        weight.redistribute(mesh, [Replicate(), Replicate()])
    print(counter.table()); counter.count("all_gather", "tp")   # 1
    with comm_scope("layers.0.mlp.experts/dispatch"):
        dist.all_to_all_single(output, input, group=ep_group)   # counted under that scope
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale.dtensor import _compat
from vescale.dtensor._comm_records import (
    BACKWARD,
    COLLECTIVES,
    FORWARD,
    OTHER_GROUP,
    WORLD_GROUP,
    CollectiveCall,
    CollectiveTotals,
    CommAccountingError,
    bytes_moved,
    scope_matches,
)

__all__ = [
    "BACKWARD",
    "COLLECTIVES",
    "FORWARD",
    "OTHER_GROUP",
    "WORLD_GROUP",
    "CollectiveCall",
    "CollectiveTotals",
    "CommAccountingError",
    "CommCounter",
    "bytes_moved",
    "comm_scope",
    "current_comm_scope",
    "scope_matches",
]

_FUNCTIONAL = _compat.FUNCTIONAL_COLLECTIVE_NAMESPACE
_C10D = _compat.C10D_COLLECTIVE_NAMESPACE

# The label of the innermost open comm_scope (a context variable: an autograd backward that
# opens its own scope does not see the forward's).
_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("vescale_comm_scope", default=None)


@contextlib.contextmanager
def comm_scope(label: str) -> Iterator[None]:
    """Label the collectives issued inside (``CollectiveCall.scope``); scopes nest, the innermost wins.

    Example::

        with comm_scope(f"{fqn}/dispatch"):
            dist.all_to_all_single(received, tokens, output_splits, input_splits, group=group)
    """
    token = _SCOPE.set(label)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current_comm_scope() -> str | None:
    """The label of the innermost open :func:`comm_scope`, or ``None``.

    Example::

        with comm_scope("experts"):
            assert current_comm_scope() == "experts"
    """
    return _SCOPE.get()


@dataclass
class _Issued:
    """A collective's arguments, normalised: which tensors went in and came out, on which group."""

    collective: str
    group: Any
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    peer: int | None = None
    input_splits: Sequence[int] = ()
    output_splits: Sequence[int] = ()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a tensor, a list of tensors or a list of lists of tensors, flattened."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [tensor for item in value for tensor in _tensors(item)]


def _result_tensors(result: Any) -> list[torch.Tensor]:
    """The tensors an op returned, leaving out c10d's Work objects."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [tensor for item in result for tensor in _result_tensors(item)]
    return []


_Parser = Callable[[tuple[Any, ...], Any], _Issued]


def _returning(collective: str, group_arg: int, *, coalesced: bool = False) -> _Parser:
    """How to read a functional collective that takes its input at ``args[0]`` (a list of inputs
    when ``coalesced``) and its group at ``args[group_arg]``, and returns its outputs."""

    def parse(args: tuple[Any, ...], result: Any) -> _Issued:
        inputs = args[0] if coalesced else [args[0]]
        return _Issued(collective, args[group_arg], inputs, _result_tensors(result))

    return parse


# (namespace, op) -> how to read its (args, result). Functional collectives return their
# outputs; c10d ops write into tensors they were given and return a Work.
_PARSERS: dict[tuple[str, str], _Parser] = {
    (_FUNCTIONAL, "all_reduce"): _returning("all_reduce", 2),
    (_FUNCTIONAL, "all_reduce_"): lambda a, r: _Issued("all_reduce", a[2], [a[0]], [a[0]]),
    (_FUNCTIONAL, "all_reduce_coalesced"): _returning("all_reduce", 2, coalesced=True),
    (_FUNCTIONAL, "all_reduce_coalesced_"): lambda a, r: _Issued("all_reduce", a[2], a[0], a[0]),
    (_FUNCTIONAL, "all_gather_into_tensor"): _returning("all_gather", 2),
    (_FUNCTIONAL, "all_gather_into_tensor_out"): _returning("all_gather", 2),
    (_FUNCTIONAL, "all_gather_into_tensor_coalesced"): _returning("all_gather", 2, coalesced=True),
    (_FUNCTIONAL, "reduce_scatter_tensor"): _returning("reduce_scatter", 3),
    (_FUNCTIONAL, "reduce_scatter_tensor_out"): _returning("reduce_scatter", 3),
    (_FUNCTIONAL, "reduce_scatter_tensor_coalesced"): _returning("reduce_scatter", 3, coalesced=True),
    (_FUNCTIONAL, "all_to_all_single"): lambda a, r: _Issued(
        "all_to_all", a[3], [a[0]], _result_tensors(r), input_splits=a[2], output_splits=a[1]
    ),
    # DTensor's Shard(i) -> Shard(j) on NCCL: one op whose all-to-all this mode cannot see inside.
    (_compat.DTENSOR_OP_NAMESPACE, "shard_dim_alltoall"): _returning("all_to_all", 3),
    (_FUNCTIONAL, "broadcast"): lambda a, r: _Issued(
        "broadcast", a[2], [a[0]], _result_tensors(r), peer=a[1]
    ),
    (_FUNCTIONAL, "broadcast_"): lambda a, r: _Issued("broadcast", a[2], [a[0]], [a[0]], peer=a[1]),
    (_FUNCTIONAL, "isend"): lambda a, r: _Issued("send", a[3], [a[0]], [], peer=a[1]),
    (_FUNCTIONAL, "irecv"): lambda a, r: _Issued("recv", a[3], [], _result_tensors(r), peer=a[1]),
    (_C10D, "allreduce_"): lambda a, r: _Issued("all_reduce", a[1], a[0], a[0]),
    (_C10D, "allreduce_coalesced_"): lambda a, r: _Issued("all_reduce", a[1], a[0], a[0]),
    (_C10D, "allgather_"): lambda a, r: _Issued("all_gather", a[2], a[1], _tensors(a[0])),
    (_C10D, "allgather_coalesced_"): lambda a, r: _Issued("all_gather", a[2], a[1], _tensors(a[0])),
    (_C10D, "allgather_into_tensor_coalesced_"): lambda a, r: _Issued("all_gather", a[2], a[1], a[0]),
    (_C10D, "_allgather_base_"): lambda a, r: _Issued("all_gather", a[2], [a[1]], [a[0]]),
    (_C10D, "reduce_scatter_"): lambda a, r: _Issued("reduce_scatter", a[2], _tensors(a[1]), a[0]),
    (_C10D, "_reduce_scatter_base_"): lambda a, r: _Issued("reduce_scatter", a[2], [a[1]], [a[0]]),
    (_C10D, "reduce_scatter_tensor_coalesced_"): lambda a, r: _Issued("reduce_scatter", a[2], a[1], a[0]),
    (_C10D, "alltoall_"): lambda a, r: _Issued("all_to_all", a[2], a[1], a[0]),
    (_C10D, "alltoall_base_"): lambda a, r: _Issued(
        "all_to_all", a[2], [a[1]], [a[0]], input_splits=a[4], output_splits=a[3]
    ),
    (_C10D, "broadcast_"): lambda a, r: _Issued("broadcast", a[1], a[0], a[0], peer=a[2]),
    (_C10D, "reduce_"): lambda a, r: _Issued("reduce", a[1], a[0], a[0], peer=a[3]),
    (_C10D, "gather_"): lambda a, r: _Issued("gather", a[2], a[1], _tensors(a[0]), peer=a[3]),
    (_C10D, "scatter_"): lambda a, r: _Issued("scatter", a[2], _tensors(a[1]), a[0], peer=a[3]),
    (_C10D, "send"): lambda a, r: _Issued("send", a[1], a[0], [], peer=a[2]),
    (_C10D, "recv_"): lambda a, r: _Issued("recv", a[1], [], a[0], peer=a[2]),
    (_C10D, "recv_any_source_"): lambda a, r: _Issued("recv", a[1], [], a[0]),
    (_C10D, "barrier"): lambda a, r: _Issued("barrier", a[1], [], []),
    (_C10D, "monitored_barrier_"): lambda a, r: _Issued("barrier", a[1], [], []),
}


def _op_key(func: Any) -> tuple[str, str]:
    """``("_c10d_functional", "all_reduce")`` for ``torch.ops._c10d_functional.all_reduce.default``."""
    namespace, _, name = func.name().partition("::")
    return namespace, name.split(".")[0]


def _numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(tensor.numel() for tensor in tensors)


def _own_chunk_numel(tensors: Sequence[torch.Tensor], splits: Sequence[int], group_rank: int, n: int) -> int:
    """Elements of an all-to-all's input or output that stay on this rank (its own chunk)."""
    if len(tensors) > 1:
        return tensors[group_rank].numel()
    tensor = tensors[0]
    if not splits:
        return tensor.numel() // n
    row_numel = tensor.numel() // tensor.shape[0] if tensor.shape[0] else 0
    return int(splits[group_rank]) * row_numel


class _GroupTable:
    """Process groups by name -> (mesh-dim key, group size, this rank's rank in the group)."""

    def __init__(self, mesh: DeviceMesh | None) -> None:
        self._groups: dict[str, tuple[str | int, int, int]] = {}
        if mesh is not None:
            for mesh_dim in range(mesh.ndim):
                group = mesh.get_group(mesh_dim)
                key = mesh.mesh_dim_names[mesh_dim] if mesh.mesh_dim_names else mesh_dim
                self._groups.setdefault(group.group_name, (key, group.size(), group.rank()))
        world = dist.group.WORLD
        if world is not None:
            self._groups.setdefault(world.group_name, (WORLD_GROUP, world.size(), world.rank()))

    def lookup(self, group: Any) -> tuple[str, str | int, int, int]:
        """``(group_name, mesh-dim key, size, rank)`` of a group given by name or as a ScriptObject."""
        if isinstance(group, str):
            name, process_group = group, None
        else:
            process_group = group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)
            name = process_group.group_name
        if name not in self._groups:
            process_group = process_group or _compat.resolve_process_group(name)
            self._groups[name] = (OTHER_GROUP, process_group.size(), process_group.rank())
        return (name, *self._groups[name])


if TYPE_CHECKING:
    from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
else:
    _DispatchModeBase = _compat.torch_dispatch_mode_class()


class CommCounter(_DispatchModeBase):
    """Count the collectives this rank issues while the context is open.

    ``mesh`` names the dims calls are attributed to; without it every call counts under
    ``"world"`` or ``"other"``. Entering starts from zero; counters nest, each counting
    every call made inside it; :meth:`reset` starts over. Enter a
    :class:`vescale.dtensor.debug.DTensorOpLogger` inside (after) a counter, not outside
    it, so that the counter still sees the collectives of the ops the logger runs.

    Example::

        with CommCounter(mesh) as counter:
            loss = model(batch).sum(); loss.backward()
        counter.summary()[("all_reduce", "tp")].bytes_sent
    """

    def __init__(self, mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        self.mesh = mesh
        self._lock = threading.Lock()
        self._calls: list[CollectiveCall] = []
        self._in_flight: dict[int, int] = {}
        self._groups = _GroupTable(None)

    def __enter__(self) -> CommCounter:
        self.reset()
        self._groups = _GroupTable(self.mesh)
        super().__enter__()
        return self

    def reset(self) -> None:
        """Forget every call recorded so far; counting goes on if the context is open.

        Example::

            with CommCounter(mesh) as counter:
                warm_up(); counter.reset(); step()   # counts only the step
        """
        with self._lock:
            self._calls.clear()
            self._in_flight.clear()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # Wrapper subclasses (DTensor, AsyncCollectiveTensor) must desugar first: their
        # collectives and waits then come back through this mode as plain-tensor ops. Other
        # subclasses (FakeTensor, in DTensor's sharding propagation) run as they are.
        if any(hasattr(tensor_type, "__tensor_flatten__") for tensor_type in types):
            return NotImplemented
        op_key = _op_key(func) if hasattr(func, "name") else ("", "")
        if op_key == (_FUNCTIONAL, "wait_tensor"):
            result = func(*args, **kwargs)
            self._mark_completed(args[0], time.perf_counter_ns())
            return result
        parse = _PARSERS.get(op_key)
        if parse is None:
            return func(*args, **kwargs)
        phase = BACKWARD if _compat.current_autograd_node() is not None else FORWARD
        start_ns = time.perf_counter_ns()
        result = func(*args, **kwargs)
        issued_ns = time.perf_counter_ns()
        self._record(func, parse(args, result), result, phase, start_ns, issued_ns)
        return result

    def _record(
        self, func: Any, issued: _Issued, result: Any, phase: str, start_ns: int, issued_ns: int
    ) -> None:
        group_name, mesh_dim, n, group_rank = self._groups.lookup(issued.group)
        tensors = issued.inputs or issued.outputs
        dtype = tensors[0].dtype if tensors else torch.float32
        element_size = tensors[0].element_size() if tensors else 0
        numel = {
            "all_gather": _numel(issued.outputs),
            "gather": n * _numel(issued.inputs),
            "scatter": n * _numel(issued.outputs),
            "recv": _numel(issued.outputs),
            "barrier": 0,
        }.get(issued.collective, _numel(issued.inputs))
        own_in = own_out = 0
        if issued.collective == "all_to_all" and n > 1:
            own_in = _own_chunk_numel(issued.inputs, issued.input_splits, group_rank, n)
            own_out = _own_chunk_numel(issued.outputs, issued.output_splits, group_rank, n)
        bytes_sent, bytes_received = bytes_moved(
            issued.collective,
            numel * element_size,
            n,
            is_root=issued.peer == group_rank,
            own_bytes_in=own_in * element_size,
            own_bytes_out=own_out * element_size,
            output_bytes=_numel(issued.outputs) * element_size,
        )
        with self._lock:
            index = len(self._calls)
            call = CollectiveCall(
                index=index,
                collective=issued.collective,
                op_name=func.name(),
                mesh_dim=mesh_dim,
                group_name=group_name,
                group_size=n,
                group_rank=group_rank,
                dtype=dtype,
                input_shapes=tuple(tuple(tensor.shape) for tensor in issued.inputs),
                output_shapes=tuple(tuple(tensor.shape) for tensor in issued.outputs),
                numel=numel,
                bytes_sent=bytes_sent,
                bytes_received=bytes_received,
                peer=issued.peer,
                phase=phase,
                start_ns=start_ns,
                issued_ns=issued_ns,
                # DTensor's own all-to-all op waits before it returns.
                completed_ns=issued_ns if func.namespace == _compat.DTENSOR_OP_NAMESPACE else None,
                scope=_SCOPE.get(),
            )
            self._calls.append(call)
            if func.namespace == _FUNCTIONAL:
                for tensor in _result_tensors(result):
                    self._in_flight[tensor.untyped_storage().data_ptr()] = index
        if func.namespace == _C10D:
            self._watch_work(result, index)

    def _watch_work(self, result: Any, index: int) -> None:
        """Note the completion time of an eager call's Work when its future completes."""
        for work_object in result if isinstance(result, tuple) else (result,):
            if not isinstance(work_object, torch.ScriptObject):
                continue
            try:
                future = dist.distributed_c10d.Work.unbox(work_object).get_future()
            except RuntimeError:
                return  # a backend without futures: the completion stays unknown (None)
            future.then(lambda _future: self._complete(index, time.perf_counter_ns()))

    def _mark_completed(self, tensor: torch.Tensor, completed_ns: int) -> None:
        with self._lock:
            index = self._in_flight.pop(tensor.untyped_storage().data_ptr(), None)
        if index is not None:
            self._complete(index, completed_ns)

    def _complete(self, index: int, completed_ns: int) -> None:
        with self._lock:
            if index < len(self._calls) and self._calls[index].completed_ns is None:
                self._calls[index] = replace(self._calls[index], completed_ns=completed_ns)

    @property
    def calls(self) -> tuple[CollectiveCall, ...]:
        """Every collective call recorded, in the order this rank issued them."""
        with self._lock:
            return tuple(self._calls)

    def summary(self) -> dict[tuple[str, str | int], CollectiveTotals]:
        """``{(collective, mesh_dim): CollectiveTotals}``, keys in order of first occurrence.

        Example::

            totals = counter.summary()[("all_gather", "tp")]
            assert totals.count == 1 and totals.numel == 8 * 16
        """
        totals: dict[tuple[str, str | int], CollectiveTotals] = {}
        for call in self.calls:
            key = (call.collective, call.mesh_dim)
            totals[key] = totals.get(key, CollectiveTotals()).add(call)
        return totals

    def scopes(self) -> dict[tuple[str, str | int, str | None], CollectiveTotals]:
        """``{(collective, mesh_dim, scope): CollectiveTotals}``: :meth:`summary` split by
        :func:`comm_scope` label, keys in order of first occurrence.

        Example::

            counter.scopes()[("all_to_all", "ep", "model.layers.1.mlp.experts/dispatch")].bytes_sent
        """
        totals: dict[tuple[str, str | int, str | None], CollectiveTotals] = {}
        for call in self.calls:
            key = (call.collective, call.mesh_dim, call.scope)
            totals[key] = totals.get(key, CollectiveTotals()).add(call)
        return totals

    def totals(
        self, collective: str | None = None, mesh_dim: str | int | None = None, scope: str | None = None
    ) -> CollectiveTotals:
        """The calls of one collective and/or mesh dim and/or scope summed (``None`` matches every one).

        ``scope`` matches a :func:`comm_scope` label and every label under it (``scope + "/..."``).

        Example::

            counter.totals(mesh_dim="tp").bytes_sent   # every tp collective's bytes
            counter.totals("all_to_all", scope="model.layers.1.mlp.experts").count
        """
        if collective is not None and collective not in COLLECTIVES:
            raise CommAccountingError(
                f"unknown collective {collective!r}; count one of {', '.join(COLLECTIVES)}"
            )
        result = CollectiveTotals()
        for call in self.calls:
            if (
                collective in (None, call.collective)
                and (mesh_dim is None or mesh_dim == call.mesh_dim)
                and (scope is None or scope_matches(call.scope, scope))
            ):
                result = result.add(call)
        return result

    def count(
        self, collective: str | None = None, mesh_dim: str | int | None = None, scope: str | None = None
    ) -> int:
        """How many calls of ``collective`` on ``mesh_dim`` (``None`` matches every one).

        Example::

            assert counter.count("all_reduce", "tp") == 4
            assert counter.count() == 4   # nothing else was issued
        """
        return self.totals(collective, mesh_dim, scope).count

    def table(self) -> str:
        """A readable table: one row per (collective, mesh dim), then the total.

        Example::

            print(counter.table())
            # collective  mesh dim  calls  elements  bytes sent  bytes received
        """
        header = ("collective", "mesh dim", "calls", "elements", "bytes sent", "bytes received")
        rows = [
            (name, str(dim), str(t.count), f"{t.numel:,}", f"{t.bytes_sent:,.0f}", f"{t.bytes_received:,.0f}")
            for (name, dim), t in self.summary().items()
        ]
        total = self.totals()
        rows.append(
            (
                "total",
                "",
                str(total.count),
                f"{total.numel:,}",
                f"{total.bytes_sent:,.0f}",
                f"{total.bytes_received:,.0f}",
            )
        )
        widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i < 2 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"CommCounter(mesh={self.mesh!r}, calls={len(self.calls)})"
