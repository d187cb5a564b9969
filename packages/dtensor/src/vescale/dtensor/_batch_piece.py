"""Which piece of the global batch this rank's forward is running (see :mod:`vescale.dtensor.batch_random`).

A process-wide value, not a thread-local one: the autograd engine runs a CUDA backward (and the
recomputation of checkpointed blocks in it) on its own threads, which must see the piece the
forward ran.

Example::

    piece = BatchPiece(start=4, rows=2, total=8)    # rows 4 and 5 of a global batch of 8
    piece.rows_factor(6)                             # 3: a (6, ...) tensor holds 3 rows a sample
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchPiece", "current_piece", "set_current_piece"]


@dataclass(frozen=True)
class BatchPiece:
    """Rows ``[start, start + rows)`` of a global batch of ``total`` rows (samples).

    Example::

        BatchPiece(start=0, rows=4, total=8)   # dp rank 0 of 2, no micro-batches
    """

    start: int
    rows: int
    total: int

    def __post_init__(self) -> None:
        if not (self.start >= 0 and self.rows > 0 and self.start + self.rows <= self.total):
            raise ValueError(
                f"a batch piece is rows [start, start + rows) of the global batch's total rows; got "
                f"start={self.start}, rows={self.rows}, total={self.total}"
            )

    def rows_factor(self, leading_size: int) -> int | None:
        """Tensor rows per sample of a tensor whose leading dim is ``leading_size`` (a (batch, ...),
        (batch * seq, ...) or (batch * heads, ...) activation), or None when it cannot be batch-major."""
        if leading_size <= 0 or leading_size % self.rows:
            return None
        return leading_size // self.rows

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
