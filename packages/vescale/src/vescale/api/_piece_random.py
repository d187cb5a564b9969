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

Not covered (each piece draws as before, for its own rows): a pipeline's micro-batches (each
stage runs only its layers, so the others' draws are not known to it), compiled modules (the
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

from collections.abc import Callable
from typing import Any

import torch

from vescale.dtensor.batch_random import BatchPiece, batch_piece_random

__all__ = ["PieceCall", "PieceRandomness"]


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
        # CPU's generator is a word stream a piece can skip through (its rows' words only). A
        # counter-based one (CUDA's Philox) gives a piece its rows only from the whole batch's
        # draw: dp x micro-batches times the mask's memory on every rank, which a large dp
        # cannot hold; there each piece draws for its own rows, as before.
        self.enabled = device_type == "cpu"

    def call(self, *, training: bool, rows_per_piece: int, pieces: int) -> PieceCall:
        """One call of the model on this rank's ``rows_per_piece * pieces`` rows, cut into ``pieces``."""
        rank_rows = rows_per_piece * pieces
        total = rank_rows * self.batch_ranks
        cut = self.enabled and total > rows_per_piece
        first = self.batch_rank * rank_rows
        return PieceCall(
            self,
            training,
            [BatchPiece(first + index * rows_per_piece, rows_per_piece, total) for index in range(pieces)]
            if cut
            else None,
        )


class PieceCall:
    """One call's pieces and the generator state its forward started from."""

    def __init__(self, owner: PieceRandomness, training: bool, pieces: list[BatchPiece] | None) -> None:
        self.owner = owner
        self.training = training
        self.pieces = pieces
        self.start_states = _generator_states(owner.device_type) if pieces is not None else ()

    def run_piece(self, index: int, forward: Callable[[], Any], then: Callable[[Any], None]) -> Any:
        """``then(forward())`` for piece ``index``, its random ops drawn as one device draws them."""
        if self.pieces is None:
            output = forward()
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
        with batch_piece_random(self.pieces[index]) as record:
            output = forward()
            then(output)
        self.owner.draws[self.training] = record.random_ops > 0
        return output


def _moved(start_states: tuple[torch.Tensor, ...], device_type: str) -> bool:
    now = _generator_states(device_type)
    return any(not torch.equal(before, after) for before, after in zip(start_states, now, strict=True))
