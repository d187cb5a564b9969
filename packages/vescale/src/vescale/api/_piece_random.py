"""Dropout of one device when the global batch is cut into pieces (dp ranks, micro-batches).

A random op in the forward (dropout, router noise) draws for the rows it sees. One device sees
the whole global batch; a dp rank or a micro-batch sees some of its rows and, left alone, draws
as if they were all of it. :class:`PieceRandomness` runs each piece's forward (and the backward
that ``vescale.parallelize`` runs for a micro-batch, recomputation included) from the generator
state the call started from, under :func:`vescale.dtensor.batch_random.batch_piece_random`, so
every piece gets its rows of the single device's draw and the generator ends where one device's
would.

The dispatch mode that does it costs Python time on every op, so it runs only where the forward
draws random numbers: a model's first call in each mode (train / eval) runs under it and counts
its random ops; later calls run under it only if that count was not zero. If a forward run
without it moves the generator after all (dropout switched on later), that piece's forward runs
again under it (its output is dropped; a second forward of that piece, once).

Where a random op's tensor holds the piece's rows (dim 0 of GPT-2's ``(batch, seq, hidden)``,
dim 1 of XLNet's sequence-first ``(seq, batch, hidden)``) is learned once, at the first forward
that draws: a forward without gradients of the same piece with its rows doubled (its output
dropped, the model's buffers and the generators put back) gives each random op's shape at a
second batch size (:func:`vescale.dtensor.batch_random.batch_layout`). If the layout reads any
of that first forward's tensors otherwise than as batch-major, the forward runs again with it.

A pipeline replays its stages' micro-batches itself (:mod:`vescale.dpipe.random_carry`); this
module gives it the rank's rows in the global batch. Not covered (each piece draws as before,
for its own rows, and :func:`warn_unreplayed_draws` says so once): compiled modules (the
compiler generates its random numbers itself), a single-piece call whose backward the caller
runs through ``transformers``' own gradient checkpointing (its recomputation cannot be run
under the mode), and devices whose generator cannot skip to a piece's rows (CUDA's Philox:
exactness would need every rank to draw the whole global batch's masks).

Example::

    randomness = PieceRandomness(batch_rank=1, batch_ranks=2, device_type="cpu")
    call = randomness.call(training=True, rows_per_piece=2, pieces=2)
    output = call.run_piece(0, lambda: model(**first_micro_batch), lambda out: out.loss.backward())
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from vescale.api.errors import NotSingleDeviceWarning
from vescale.dtensor.batch_random import (
    BatchPiece,
    BatchPieceRandom,
    batch_layout,
    batch_piece_random,
    count_random_ops,
)

__all__ = ["PieceCall", "PieceRandomness", "warn_unreplayed_draws"]

# The reasons already warned of in this process (once each).
_WARNED: set[str] = set()


def warn_unreplayed_draws(reason: str) -> None:
    """Warn, once per ``reason`` in a process, that a cut batch's random draws are not one device's.

    Example::

        warn_unreplayed_draws("under a pipeline")
    """
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"the forward drew random numbers (dropout) on a piece of the global batch {reason}: each piece "
        "drew them for its own rows as if they were the whole batch, so its masks are not one device's "
        "and losses and gradients differ from a single-device run by that randomness; set the model's "
        "dropout to 0 to compare with one device (vescale.manual_seed lists what is covered)",
        NotSingleDeviceWarning,
        stacklevel=4,
    )


def _generator_states(device_type: str) -> tuple[torch.Tensor, ...]:
    states = [torch.get_rng_state()]
    if device_type != "cpu":
        states.append(torch.get_device_module(device_type).get_rng_state())
    return tuple(states)


def _restore(device_type: str, states: tuple[torch.Tensor, ...]) -> None:
    torch.set_rng_state(states[0])
    if device_type != "cpu":
        torch.get_device_module(device_type).set_rng_state(states[1])


class PieceRandomness:
    """What one parallelized model knows of its forward's random draws, by training mode.

    Example::

        randomness = PieceRandomness(batch_rank=0, batch_ranks=2, device_type="cpu")
    """

    def __init__(self, *, batch_rank: int, batch_ranks: int, device_type: str) -> None:
        self.batch_rank = batch_rank
        self.batch_ranks = batch_ranks
        self.device_type = device_type
        # None: not known yet; True: the forward draws random numbers; False: it does not.
        self.draws: dict[bool, bool | None] = {True: None, False: None}
        # Where each random tensor holds the batch's rows (BatchPiece.layout); None: not learned yet.
        self.layout: tuple[tuple[int, int | None], ...] | None = None
        # Why the replay is off (None: it is on). CPU's generator is a word stream a piece can
        # skip through (its rows' words only). A counter-based one (CUDA's Philox) gives a piece
        # its rows only from the whole batch's draw: dp x micro-batches times the mask's memory on
        # every rank, which a large dp cannot hold; there each piece draws for its own rows.
        self.off_reason: str | None = (
            None
            if device_type == "cpu"
            else f"on {device_type}, whose generator cannot skip to a piece's rows"
        )

    def call(
        self, *, training: bool, rows_per_piece: int, pieces: int, off_reason: str | None = None
    ) -> PieceCall:
        """One call of the model on this rank's ``rows_per_piece * pieces`` rows, cut into ``pieces``
        (``off_reason``: why this call cannot be replayed, if it cannot)."""
        rank_rows = rows_per_piece * pieces
        total = rank_rows * self.batch_ranks
        reason = off_reason or self.off_reason
        if total <= rows_per_piece:  # the whole global batch in one piece: nothing to replay
            return PieceCall(self, training, None, None)
        if reason is not None:
            return PieceCall(self, training, None, reason)
        first = self.batch_rank * rank_rows
        pieces_of_call = [
            BatchPiece(first + index * rows_per_piece, rows_per_piece, total) for index in range(pieces)
        ]
        return PieceCall(self, training, pieces_of_call, None)


class PieceCall:
    """One call's pieces and the generator state its forward started from."""

    def __init__(
        self,
        owner: PieceRandomness,
        training: bool,
        pieces: list[BatchPiece] | None,
        off_reason: str | None,
    ) -> None:
        self.owner = owner
        self.training = training
        self.pieces = pieces
        self.off_reason = off_reason
        watched = pieces is not None or off_reason is not None
        self.start_states = _generator_states(owner.device_type) if watched else ()

    def run_piece(
        self,
        index: int,
        forward: Callable[[], Any],
        then: Callable[[Any], None],
        resized: Callable[[], Any] | None = None,
    ) -> Any:
        """``then(forward())`` for piece ``index``, its random ops drawn as one device draws them.

        ``resized``: a forward of the same piece with its rows doubled that puts back the generators
        and buffers, run without gradients to learn the random tensors' layout at the first
        forward that draws (module docstring).
        """
        if self.pieces is None:
            output = forward()
            if self.off_reason is not None and _moved(self.start_states, self.owner.device_type):
                warn_unreplayed_draws(self.off_reason)
            then(output)
            return output
        draws = self.owner.draws[self.training]
        if draws is False:
            output = forward()
            if not _moved(self.start_states, self.owner.device_type):
                then(output)
                return output
            del output  # it drew random numbers after all: run it again as one device would
        _restore(self.owner.device_type, self.start_states)
        piece = self._piece(index)
        if self.owner.layout is not None or resized is None:
            with batch_piece_random(piece) as record:
                output = forward()
                then(output)
            self.owner.draws[self.training] = record.random_ops > 0
            return output
        with batch_piece_random(piece) as record:
            output = forward()
        self.owner.draws[self.training] = record.random_ops > 0
        if record.random_ops and self._learn_layout(record, piece, resized):
            del output  # drawn with rows where the tensors do not hold them: again, with the layout
            _restore(self.owner.device_type, self.start_states)
            piece = self._piece(index)
            with batch_piece_random(piece):
                output = forward()
        with batch_piece_random(piece):
            then(output)
        return output

    def _piece(self, index: int) -> BatchPiece:
        assert self.pieces is not None
        layout = self.owner.layout
        return self.pieces[index] if layout is None else self.pieces[index].with_layout(layout)

    def _learn_layout(self, record: BatchPieceRandom, piece: BatchPiece, resized: Callable[[], Any]) -> bool:
        """Learn the layout from ``record``'s shapes and a forward of ``resized``; whether it reads
        any recorded tensor otherwise than the batch-major reading the forward drew with."""
        with torch.no_grad(), count_random_ops() as doubled:
            resized()  # the generators and buffers are put back by it
        layout = batch_layout(record.shapes, piece.rows, doubled.shapes, 2 * piece.rows)
        self.owner.layout = layout
        learned = piece.with_layout(layout)
        return any(piece.locate(shape) != learned.locate(shape) for shape in record.shapes)


def _moved(start_states: tuple[torch.Tensor, ...], device_type: str) -> bool:
    now = _generator_states(device_type)
    return any(not torch.equal(before, after) for before, after in zip(start_states, now, strict=True))
