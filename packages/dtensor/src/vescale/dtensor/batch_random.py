"""Random numbers of one device for a piece of the global batch (a dp rank's rows, a micro-batch).

One device runs a random op (dropout) on the whole batch's activation: a global-batch-shaped
draw. A data-parallel rank or a micro-batch holds only some rows of it and, left alone, draws as
if they were the whole batch, so its masks are not the single device's (and every dp rank draws
the same ones). Under :func:`batch_piece_random`, every random op whose tensor's leading dim is a
multiple of the piece's rows (``(batch, ...)``, ``(batch * seq, ...)``, ``(batch * heads, ...)``)
gives those rows of the single-device draw and moves the generator as the whole-batch draw does:
on plain tensors through a dispatch mode, on DTensors (tensor-parallel activations) through
``vescale.dtensor.random``'s handlers. Each piece must start from the generator state the whole
batch's forward started from (the caller resets it; ``vescale.parallelize`` does).

Where a tensor holds the rows is the piece's ``layout``: learned by :func:`batch_layout` from
the random ops' shapes in two forwards of different batch sizes (a sequence-first
``(seq, batch, hidden)`` activation, XLNet's, holds them in dim 1; a tensor whose shape does
not change with the batch holds none). Without a layout, or for a number of dims it does not
list, a tensor is read as batch-major: one whose leading dim is a multiple of the piece's rows
holds them there (so, with one row a piece, a sequence-first tensor is misread), any other is
drawn as it is.
Ops covered: those of ``vescale.dtensor.random`` (``bernoulli_``, which CPU dropout runs,
``native_dropout``, the in-place fills, ``*_like``) and the ``rand``/``randn`` factories.

Example::

    state = torch.get_rng_state()
    for index, micro_batch in enumerate(micro_batches):        # 2 rows each of a global batch of 8
        torch.set_rng_state(state)
        with batch_piece_random(BatchPiece(start=2 * index, rows=2, total=8)):
            model(**micro_batch).loss.backward()                # dropout: rows of one device's masks
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from vescale.dtensor import _compat
from vescale.dtensor._batch_piece import BatchPiece, current_piece, set_current_piece
from vescale.dtensor._random_ops import RANDOM_OP_KINDS, register_random_ops
from vescale.dtensor._random_strategy import RandomCall, draw_local

__all__ = [
    "BatchPiece",
    "BatchPieceRandom",
    "batch_layout",
    "batch_piece_random",
    "batch_rows",
    "batch_with_doubled_rows",
    "count_random_ops",
    "current_piece",
]

aten = torch.ops.aten

_FACTORIES = (aten.rand.default, aten.rand.generator, aten.randn.default, aten.randn.generator)


class BatchPieceRandom:
    """What :func:`batch_piece_random` and :func:`count_random_ops` yield: ``random_ops``, the
    random ops run so far under it, and ``shapes``, the (global) shape of each one's tensor."""

    def __init__(self, piece: BatchPiece | None) -> None:
        self.piece = piece
        self.random_ops = 0
        self.shapes: list[tuple[int, ...]] = []


def batch_layout(
    shapes: Sequence[Sequence[int]], rows: int, other_shapes: Sequence[Sequence[int]], other_rows: int
) -> tuple[tuple[int, int | None], ...]:
    """Where each number of dims holds the batch, from the random ops' tensor shapes of two forwards
    (``shapes`` of a batch of ``rows``, ``other_shapes`` of ``other_rows``), for
    :class:`BatchPiece`'s ``layout``.

    A dim whose size scales with the rows holds them; a tensor whose shape stays holds none. A
    number of dims whose tensors disagree, or whose change is not one dim scaling with the rows,
    is left out (read as batch-major); so is every one when the two forwards ran different ops.

    Example::

        batch_layout([(16, 2, 32), (16, 16, 2, 4)], 2, [(16, 3, 32), (16, 16, 3, 4)], 3)
        # ((3, 1), (4, 2)): XLNet's sequence-first activations and attention probabilities
    """
    if len(shapes) != len(other_shapes) or rows == other_rows:
        return ()
    found: dict[int, int | None] = {}
    unclear: set[int] = set()
    for shape, other in zip(shapes, other_shapes, strict=True):
        ndim = len(shape)
        changed = [dim for dim in range(ndim) if ndim == len(other) and shape[dim] != other[dim]]
        dim: int | None
        if ndim != len(other) or len(changed) > 1:
            unclear.add(ndim)
            continue
        if not changed:
            dim = None
        else:
            dim = changed[0]
            if shape[dim] % rows or other[dim] % other_rows or shape[dim] // rows != other[dim] // other_rows:
                unclear.add(ndim)
                continue
        if found.setdefault(ndim, dim) != dim:
            unclear.add(ndim)
    return tuple(sorted((ndim, dim) for ndim, dim in found.items() if ndim not in unclear))


def batch_rows(batch: Mapping[str, Any]) -> int:
    """The batch's rows (samples): the leading size of its first tensor with a dim (0 if none).

    Example::

        batch_rows({"input_ids": torch.zeros(2, 16, dtype=torch.long)})   # 2
    """
    return next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)


def batch_with_doubled_rows(batch: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """The batch's rows (:func:`batch_rows`) and the batch with each tensor of that leading size
    repeated twice: the second size :func:`batch_layout` needs.

    Example::

        rows, doubled = batch_with_doubled_rows({"input_ids": torch.zeros(2, 16, dtype=torch.long)})
        rows, doubled["input_ids"].shape   # 2, (4, 16)
    """
    rows = batch_rows(batch)
    doubled = {
        key: torch.cat([value, value])
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows
        else value
        for key, value in batch.items()
    }
    return rows, doubled


@contextlib.contextmanager
def count_random_ops() -> Iterator[BatchPieceRandom]:
    """Count the random ops run inside (fake tensors too: a shapes-only forward), changing nothing.

    Example::

        with count_random_ops() as counted:
            model(**batch)
        counted.random_ops   # 4 for a 2-layer GPT-2 in training mode... 0 without dropout
    """
    record = BatchPieceRandom(None)
    with _replay_mode_class()(record):
        yield record


@contextlib.contextmanager
def batch_piece_random(piece: BatchPiece) -> Iterator[BatchPieceRandom]:
    """Run a forward (and its backward, whose recomputed blocks draw again) as ``piece`` of the batch.

    Entered again with the piece already current (a recomputation inside the piece's own
    backward), it adds nothing.

    Example::

        with batch_piece_random(BatchPiece(start=4, rows=4, total=8)) as replay:   # dp rank 1 of 2
            loss = model(**batch).loss
        replay.random_ops   # 0: the forward drew no random numbers
    """
    record = BatchPieceRandom(piece)
    if current_piece() == piece:
        yield record
        return
    register_random_ops()
    previous = set_current_piece(piece)
    try:
        with _replay_mode_class()(record):
            yield record
    finally:
        set_current_piece(previous)


def _run_plain(
    record: BatchPieceRandom, func: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    call_kwargs = dict(kwargs)
    generator = call_kwargs.pop("generator", None)
    if kind == "factory":
        dtype = call_kwargs.get("dtype") or torch.get_default_dtype()
        device = call_kwargs.get("device") or torch.device("cpu")
        template = torch.empty(list(args[0]), dtype=dtype, device=device)
    else:
        template = args[0]
    shape = tuple(template.shape)
    piece = record.piece
    if piece is None or piece.whole or template.is_meta or piece.locate(shape) is None:
        return func(*args, **kwargs)
    call = RandomCall(func, kind, tuple(args[1:]), call_kwargs, generator)
    outputs = draw_local(call, None, (), shape, template.stride(), lambda: template, template)
    if kind == "fill":
        return args[0]
    return outputs if len(outputs) > 1 else outputs[0]


def _random_tensor_shape(kind: str, args: tuple[Any, ...]) -> tuple[int, ...]:
    """The shape of the tensor a random op draws for (a DTensor's global shape)."""
    if kind == "factory":
        return tuple(int(size) for size in args[0])
    return tuple(args[0].shape)


@functools.cache
def _replay_mode_class() -> type:
    """The dispatch mode of a piece (its base class is private, hence built on first use)."""

    if TYPE_CHECKING:
        from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
    else:
        _DispatchModeBase = _compat.torch_dispatch_mode_class()

    class BatchPieceRandomMode(_DispatchModeBase):
        def __init__(self, record: BatchPieceRandom) -> None:
            super().__init__()
            self.record = record

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = kwargs or {}
            kind = "factory" if func in _FACTORIES else RANDOM_OP_KINDS.get(func)
            if kind is None:
                return func(*args, **kwargs)
            self.record.random_ops += 1
            self.record.shapes.append(_random_tensor_shape(kind, args))
            if self.record.piece is None:  # counting only
                return func(*args, **kwargs)
            if any(isinstance(leaf, DTensor) for leaf in tree_flatten((args, kwargs))[0]):
                return func(*args, **kwargs)  # vescale.dtensor.random's handler reads the current piece
            return _run_plain(self.record, func, kind, args, kwargs)

    return BatchPieceRandomMode
