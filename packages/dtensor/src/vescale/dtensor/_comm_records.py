"""What :class:`vescale.dtensor.comm.CommCounter` records, and how it counts bytes.

One :class:`CollectiveCall` per collective a rank issues, and :class:`CollectiveTotals`
summed per (collective, mesh dim). Bytes follow :func:`bytes_moved`, the bandwidth-optimal
(ring) algorithm's bytes per rank; every call also keeps its raw shapes, so a reader can
apply another convention. The sizes are those of the tensors the collective really moved:
where DTensor pads an uneven shard before an all-gather or reduce-scatter, the padding
counts; veScale's Shard(i) -> Shard(j) all-to-all sends the exact pieces, unpadded.

Calls issued inside :func:`~vescale.dtensor.comm.comm_scope` carry its label (``scope``), so
that one module's collectives (an MoE layer's all-to-alls) can be summed apart.

The names defined here are public as :mod:`vescale.dtensor.comm`'s, whose ``__all__`` lists
them; this private module keeps no second list.

Example::

    call = counter.calls[0]
    print(call.collective, call.mesh_dim, call.numel, call.bytes_sent, call.input_shapes)
    totals = counter.summary()[("all_reduce", "tp")]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vescale.dtensor.errors import DTensorError

# The mesh-dim key of collectives on the default (world) group, and on any other group that
# is not one of the counter mesh's dimensions.
WORLD_GROUP = "world"
OTHER_GROUP = "other"

FORWARD = "forward"
BACKWARD = "backward"

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
)


class CommAccountingError(DTensorError, ValueError):
    """A collective or mesh dim that communication accounting does not know."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as one rank issued it.

    ``numel`` is the collective's size S in elements, the quantity its byte count scales
    with: the reduced tensor (all_reduce, reduce), the gathered output (all_gather, gather),
    the unreduced input (reduce_scatter), the input (all_to_all, scatter: the root's whole
    input), the broadcast tensor, the sent or received tensor (send, recv). Coalesced calls
    sum their tensors. Times are ``time.perf_counter_ns()`` on this rank: ``start_ns`` before
    the op runs, ``issued_ns`` when it returned (the work may still be in flight),
    ``completed_ns`` when the completion was seen (a functional collective's
    ``wait_tensor``, or an eager call's work finishing), ``None`` if it never was inside
    the counter. ``scope`` is the label of the innermost
    :func:`vescale.dtensor.comm.comm_scope` open when the call was issued (e.g.
    ``"model.layers.0.mlp.experts/dispatch"``), ``None`` outside every scope.
    """

    index: int
    collective: str
    op_name: str
    mesh_dim: str | int
    group_name: str
    group_size: int
    group_rank: int
    dtype: torch.dtype
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    numel: int
    bytes_sent: float
    bytes_received: float
    peer: int | None
    phase: str
    start_ns: int
    issued_ns: int
    completed_ns: int | None = None
    scope: str | None = None

    @property
    def element_size(self) -> int:
        """Bytes per element of the collective's dtype."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def size_bytes(self) -> int:
        """The collective's size S in bytes: ``numel * element_size``."""
        return self.numel * self.element_size


@dataclass(frozen=True)
class CollectiveTotals:
    """The calls of one (collective, mesh dim) summed: count, elements (S) and bytes."""

    count: int = 0
    numel: int = 0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0

    def add(self, call: CollectiveCall) -> CollectiveTotals:
        """These totals with ``call`` added."""
        return CollectiveTotals(
            self.count + 1,
            self.numel + call.numel,
            self.bytes_sent + call.bytes_sent,
            self.bytes_received + call.bytes_received,
        )


def scope_matches(scope: str | None, wanted: str) -> bool:
    """Whether a call's ``scope`` is ``wanted`` or lies under it (``wanted + "/..."``).

    Example::

        scope_matches("layers.0.mlp.experts/dispatch", "layers.0.mlp.experts")   # True
    """
    return scope is not None and (scope == wanted or scope.startswith(wanted + "/"))


def bytes_moved(
    collective: str,
    size_bytes: int,
    group_size: int,
    *,
    is_root: bool = False,
    own_bytes_in: int = 0,
    own_bytes_out: int = 0,
    output_bytes: int | None = None,
) -> tuple[float, float]:
    """``(bytes_sent, bytes_received)`` of one rank for one collective of size ``size_bytes`` (S).

    The convention (n = ``group_size``; a group of one moves nothing):

    - all_reduce: 2(n-1)/n·S each way (ring reduce-scatter, then ring all-gather);
    - all_gather: (n-1)/n·S each way, S the gathered output;
    - reduce_scatter: (n-1)/n·S each way, S the unreduced input;
    - all_to_all: exact, the input minus the rank's own chunk sent, the output minus the
      chunk it keeps received (``own_bytes_in``/``own_bytes_out``; ``output_bytes`` when the
      splits are uneven, else the output is S);
    - broadcast: the root sends S, every other rank receives S (pipelined-chain forwarding is
      not counted; this is nccl-tests' bus-bytes factor 1);
    - reduce: every non-root rank sends S, the root receives S (same factor 1);
    - gather: each non-root sends its S/n, the root receives (n-1)/n·S;
    - scatter: the root sends (n-1)/n·S, each non-root receives S/n;
    - send, recv: S one way; barrier: nothing.

    Example::

        bytes_moved("all_reduce", 4096, 4)            # (6144.0, 6144.0)
        bytes_moved("all_gather", 4096, 4)            # (3072.0, 3072.0)
        bytes_moved("broadcast", 4096, 4, is_root=True)   # (4096.0, 0.0)
    """
    n = group_size
    if n <= 1 or collective == "barrier":
        return 0.0, 0.0
    if collective == "all_reduce":
        moved = 2 * (n - 1) * size_bytes / n
        return moved, moved
    if collective in ("all_gather", "reduce_scatter"):
        moved = (n - 1) * size_bytes / n
        return moved, moved
    if collective == "all_to_all":
        received = (size_bytes if output_bytes is None else output_bytes) - own_bytes_out
        return float(size_bytes - own_bytes_in), float(received)
    if collective == "broadcast":
        return (float(size_bytes), 0.0) if is_root else (0.0, float(size_bytes))
    if collective == "reduce":
        return (0.0, float(size_bytes)) if is_root else (float(size_bytes), 0.0)
    if collective == "gather":
        return (0.0, (n - 1) * size_bytes / n) if is_root else (size_bytes / n, 0.0)
    if collective == "scatter":
        return ((n - 1) * size_bytes / n, 0.0) if is_root else (0.0, size_bytes / n)
    if collective == "send":
        return float(size_bytes), 0.0
    if collective == "recv":
        return 0.0, float(size_bytes)
    raise CommAccountingError(
        f"bytes_moved: unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}"
    )
