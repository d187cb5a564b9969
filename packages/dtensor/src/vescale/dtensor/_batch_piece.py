"""Which piece of the global batch this rank's forward is running (see :mod:`vescale.dtensor.batch_random`).

A process-wide value, not a thread-local one: the autograd engine runs a CUDA backward (and the
recomputation of checkpointed blocks in it) on its own threads, which must see the piece the
forward ran.

Example::

    piece = BatchPiece(start=4, rows=2, total=8)    # rows 4 and 5 of a global batch of 8
    piece.locate((6, 5))                             # (0, 3): dim 0 holds 3 tensor rows a sample
    seq_first = BatchPiece(4, 2, 8, layout=((3, 1),))
    seq_first.locate((16, 2, 32))                    # (1, 1): a 3-d tensor's batch is its dim 1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BatchPiece", "current_piece", "set_current_piece"]


@dataclass(frozen=True)
class BatchPiece:
    """Rows ``[start, start + rows)`` of a global batch of ``total`` rows (samples).

    ``layout`` says, for a random op's tensor of ``n`` dims, which dim holds the batch's rows
    (``(n, dim)``; ``(n, None)``: such tensors do not depend on the batch), as learned from
    the forward at two batch sizes (:func:`vescale.dtensor.batch_random.batch_layout`). A number
    of dims it does not list is read as batch-major: dim 0, where its size is a multiple of
    ``rows``.

    Example::

        BatchPiece(start=0, rows=4, total=8)   # dp rank 0 of 2, no micro-batches
    """

    start: int
    rows: int
    total: int
    layout: tuple[tuple[int, int | None], ...] = ()

    def __post_init__(self) -> None:
        if not (self.start >= 0 and self.rows > 0 and self.start + self.rows <= self.total):
            raise ValueError(
                f"a batch piece is rows [start, start + rows) of the global batch's total rows; got "
                f"start={self.start}, rows={self.rows}, total={self.total}"
            )

    def locate(self, shape: Sequence[int]) -> tuple[int, int] | None:
        """``(dim, tensor rows per sample)`` of the piece's rows in a tensor of ``shape`` (a
        ``(batch, ...)``, ``(batch * seq, ...)`` or, by its layout, ``(seq, batch, ...)``
        activation), or None when the tensor does not hold them."""
        if not shape:
            return None
        dim = dict(self.layout).get(len(shape), 0)
        if dim is None or dim >= len(shape):
            return None
        size = shape[dim]
        if size <= 0 or size % self.rows:
            return None
        return dim, size // self.rows

    def with_layout(self, layout: tuple[tuple[int, int | None], ...]) -> BatchPiece:
        """The same rows, read with ``layout``."""
        return BatchPiece(self.start, self.rows, self.total, layout)

    @property
    def whole(self) -> bool:
        """Whether the piece is the whole global batch (random ops then need no replay)."""
        return self.rows == self.total


_current: BatchPiece | None = None


def current_piece() -> BatchPiece | None:
    """The piece whose forward (or backward) is running, or None outside one."""
    return _current


def set_current_piece(piece: BatchPiece | None) -> BatchPiece | None:
    """Make ``piece`` current; return the previous one (to restore)."""
    global _current
    previous, _current = _current, piece
    return previous
