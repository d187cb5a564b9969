"""Dropout of one device under a pipeline: the generator state travels with the hidden state.

One device runs every layer's random ops (dropout) on the whole batch, in forward order. A
stage runs only its layers, on one micro-batch at a time; left alone, it drew from the state
the step started from, for the micro-batch's rows alone. Here each stage's forward of
micro-batch ``i`` starts from the state one device holds where that stage's layers begin (the
step's start on the first stage; what the previous stage sent on, after the hidden state,
on the others: :class:`GeneratorCarry` is a :class:`vescale.dpipe.stage_module.StageCarry`) and
runs under :func:`vescale.dtensor.batch_random.batch_piece_random` for the micro-batch's rows
of the global batch, so it draws those rows of one device's masks and ends where one device's
forward of its layers ends. After the schedule, every pp rank takes the last stage's end state:
the state one device ends its forward in.

CPU only (its generator is a word stream a piece can skip through), and only for models whose
forward draws random numbers (:attr:`vescale.dpipe.tracing.ModelTrace.random_ops`): the carry
is part of each stage's output, fixed when the pipeline is built.

Example::

    carry = GeneratorCarry(router)
    carry.begin_step(pieces, torch.get_rng_state(), skip_calls=1)   # a new schedule's shape pass
    # ... the stage module calls carry.start(received, batch) and carry.finish() around its forward
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vescale.dtensor.batch_random import BatchPiece, batch_piece_random

if TYPE_CHECKING:
    from vescale.dpipe.stage_module import StageRouter

__all__ = ["GeneratorCarry", "micro_batch_pieces"]


def micro_batch_pieces(first_row: int, rows: int, total_rows: int, microbatches: int) -> list[BatchPiece]:
    """The pieces of the global batch that ``microbatches`` equal micro-batches of this rank's
    ``rows`` (from ``first_row`` of ``total_rows``) are.

    Example::

        micro_batch_pieces(4, 4, 8, 2)   # dp rank 1 of 2: rows 4-5 and 6-7 of 8
    """
    size = rows // microbatches
    return [BatchPiece(first_row + index * size, size, total_rows) for index in range(microbatches)]


class GeneratorCarry:
    """One stage's generator state in, its state after its layers' draws out (see the module docstring)."""

    def __init__(self, router: StageRouter) -> None:
        self.router = router
        self.pieces: Sequence[BatchPiece] = ()
        self.step_state: torch.Tensor | None = None
        # The state after this stage's last forward (the last stage's: where one device's forward ends).
        self.end_state: torch.Tensor | None = None
        self._calls = 0
        self._skip_calls = 0
        self._replay: contextlib.AbstractContextManager[Any] | None = None

    def begin_step(self, pieces: Sequence[BatchPiece], step_state: torch.Tensor, *, skip_calls: int) -> None:
        """Replay the next forwards as ``pieces`` (in micro-batch order), after ``skip_calls`` calls
        that are not micro-batches (PyTorch's shape pass on a new schedule's first step)."""
        self.pieces, self.step_state = tuple(pieces), step_state
        self.end_state, self._calls, self._skip_calls = None, 0, skip_calls

    def end_step(self) -> None:
        """Stop replaying (a forward outside a step passes the state through)."""
        self.pieces, self.step_state = (), None

    def start(self, received: torch.Tensor | None, batch: Mapping[str, Any]) -> None:
        call, self._calls = self._calls, self._calls + 1
        if self.step_state is None or call < self._skip_calls:
            return
        index = call - self._skip_calls
        if index >= len(self.pieces):
            return
        piece = self.pieces[index]
        if received is None:  # the first stage: its part of the forward starts here
            self._enter(self.step_state, piece)
            return
        # A later stage: the model's code before its first unit re-runs the earlier stages' glue
        # on stand-ins, drawing from the step's state as the first stage does there. One device's
        # masks matter where the glue's output is used (XLNet's dropout of the relative position
        # embedding its every layer reads; GPT-2's embedding dropout falls on the skipped
        # embedding's zeros). Its own units' draws start from the state received with its hidden
        # state, where that is swapped in.
        state = received.clone()
        self._enter(self.step_state, piece)
        self.router.on_stage_entry = lambda: torch.set_rng_state(state)

    def _enter(self, state: torch.Tensor, piece: BatchPiece) -> None:
        torch.set_rng_state(state)
        self._replay = batch_piece_random(piece)
        self._replay.__enter__()

    def finish(self) -> torch.Tensor:
        self.router.on_stage_entry = None
        if self._replay is not None:
            replay, self._replay = self._replay, None
            replay.__exit__(None, None, None)
        self.end_state = torch.get_rng_state()
        return self.end_state
