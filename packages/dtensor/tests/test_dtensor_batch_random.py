"""Random ops on a piece of the global batch against the same ops on the whole batch in one process.

Reference: one process draws every tensor at the whole batch's size. Each piece (rows
``[start, start + rows)``) starts from the same generator state, runs the same calls on its rows
under ``batch_piece_random`` and must give exactly those rows (``torch.equal``) and end in the
whole run's generator state. Without the replay a piece draws as if its rows were the whole
batch: the first piece's first op matches by construction, nothing after it does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.dtensor.batch_random import BatchPiece, batch_layout, batch_piece_random, count_random_ops
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.random import manual_seed
from vescale.dtensor.testing import run_on_ranks

SEED = 3
TOTAL = 8
SEQUENCE, HIDDEN = 5, 6


def draws(x: torch.Tensor, noise_rows: int) -> list[torch.Tensor]:
    """What a forward might draw on ``x`` (rows, SEQUENCE, HIDDEN): every family the replay covers."""
    rows = x.shape[0]
    # A layout whose memory order is not its dim order: drawn whole and cut (the slice needs one run).
    transposed = x.transpose(1, 2).contiguous().transpose(1, 2)
    return [
        F.dropout(x, 0.3),  # bernoulli_ on an empty_like: words sliced
        torch.randn(rows, SEQUENCE),  # a factory
        F.dropout(
            x.reshape(rows * SEQUENCE, HIDDEN) * 2, 0.5
        ),  # (batch * seq, hidden): 5 tensor rows a sample
        torch.rand_like(x),
        torch.empty(rows, 16).normal_(),  # normal_ draws in 16-element blocks
        torch.empty_like(transposed).bernoulli_(0.5),
        torch.randn(noise_rows, 4),  # not batch-major: drawn as it is, by every piece alike
    ]


def whole_batch(x: torch.Tensor, noise_rows: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(SEED)
    values = draws(x, noise_rows)
    return values, torch.get_rng_state()


@pytest.mark.parametrize("rows", [2, 4])
def test_each_piece_draws_its_rows_of_the_whole_batchs_random_numbers(rows):
    x = torch.randn(TOTAL, SEQUENCE, HIDDEN, generator=torch.Generator().manual_seed(0))
    noise_rows = 7  # not a multiple of the piece's rows
    expected, expected_state = whole_batch(x, noise_rows)
    for start in range(0, TOTAL, rows):
        torch.manual_seed(SEED)
        with batch_piece_random(BatchPiece(start, rows, TOTAL)) as record:
            got = draws(x[start : start + rows], noise_rows)
        assert record.random_ops == len(expected)
        for index, (value, whole) in enumerate(zip(got, expected, strict=True)):
            per_sample = SEQUENCE if index == 2 else 1
            wanted = (
                whole
                if index == len(expected) - 1
                else whole[start * per_sample : (start + rows) * per_sample]
            )
            assert torch.equal(value, wanted), (start, index)
        assert torch.equal(torch.get_rng_state(), expected_state), start


def test_without_the_replay_pieces_draw_other_numbers():
    """The check above can fail: the same calls on the pieces without the replay."""
    x = torch.randn(TOTAL, SEQUENCE, HIDDEN, generator=torch.Generator().manual_seed(0))
    expected, _ = whole_batch(x, 7)
    torch.manual_seed(SEED)
    second_piece = draws(x[4:8], 7)
    assert not torch.equal(second_piece[0], expected[0][4:8])


HEADS = 3


def sequence_first_draws(x: torch.Tensor) -> list[torch.Tensor]:
    """XLNet's random ops: dropout of (seq, batch, hidden) activations and of (seq, seq, batch,
    heads) attention probabilities; ``x`` is (seq, rows, hidden)."""
    rows = x.shape[1]
    return [
        F.dropout(x, 0.3),
        F.dropout(torch.ones(SEQUENCE, SEQUENCE, rows, HEADS), 0.5),
        torch.randn(4, HIDDEN),  # the same for every batch size: drawn as it is
        F.dropout(x * 2, 0.1),
    ]


def _layout_of_sequence_first_draws() -> tuple[tuple[int, int | None], ...]:
    recorded = []
    for rows in (1, 2):
        with count_random_ops() as counted:
            sequence_first_draws(torch.ones(SEQUENCE, rows, HIDDEN))
        recorded.append(counted.shapes)
    return batch_layout(recorded[0], 1, recorded[1], 2)


def test_the_layout_of_sequence_first_tensors_is_learned_from_two_batch_sizes():
    assert _layout_of_sequence_first_draws() == ((2, None), (3, 1), (4, 2))
    # Ops that differ between the two forwards, or a dim that does not scale with the rows: unknown.
    assert batch_layout([(4, 2)], 2, [(4, 3), (5,)], 3) == ()
    assert batch_layout([(5, 2)], 2, [(6, 3)], 3) == ()
    assert batch_layout([(5, 2), (2, 7)], 2, [(5, 3), (3, 7)], 3) == ()


@pytest.mark.parametrize("rows", [1, 2])
def test_a_sequence_first_piece_draws_its_rows_with_its_layout(rows):
    x = torch.randn(SEQUENCE, TOTAL, HIDDEN, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(SEED)
    expected = sequence_first_draws(x)
    expected_state = torch.get_rng_state()
    layout = _layout_of_sequence_first_draws()
    for start in range(0, TOTAL, rows):
        torch.manual_seed(SEED)
        with batch_piece_random(BatchPiece(start, rows, TOTAL, layout)):
            got = sequence_first_draws(x[:, start : start + rows])
        for index, (value, whole) in enumerate(zip(got, expected, strict=True)):
            wanted = whole if index == 2 else whole.narrow(index + 1 if index == 1 else 1, start, rows)
            assert torch.equal(value, wanted), (start, index)
        assert torch.equal(torch.get_rng_state(), expected_state), start
    # Without the layout, a sequence-first piece of one row is read as batch-major: other masks.
    torch.manual_seed(SEED)
    with batch_piece_random(BatchPiece(1, 1, TOTAL)):
        misread = sequence_first_draws(x[:, 1:2])
    assert not torch.equal(misread[0], expected[0][:, 1:2])


def test_reentering_the_current_piece_adds_nothing():
    piece = BatchPiece(0, 2, TOTAL)
    with batch_piece_random(piece) as outer, batch_piece_random(piece) as inner:
        F.dropout(torch.ones(2, 3), 0.5)
    assert (outer.random_ops, inner.random_ops) == (1, 0)


def test_a_piece_outside_its_batch_is_refused_with_its_numbers():
    with pytest.raises(ValueError, match="start=6, rows=4, total=8"):
        BatchPiece(6, 4, 8)


# --- runs on the ranks (module level: ranks look them up by name) ---


def sequence_parallel_dropout_on_ranks(start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout of a (rows, SEQUENCE * 2, HIDDEN) activation sharded on its sequence (tensor-parallel
    ranks under sequence parallelism), then a plain draw; the full values are returned."""
    manual_seed(SEED)
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), (dist.get_world_size(),))
    x = torch.randn(TOTAL, SEQUENCE * 2, HIDDEN, generator=torch.Generator().manual_seed(0))
    with batch_piece_random(BatchPiece(start, rows, TOTAL)):
        sharded = DTensor.from_local(x[start : start + rows], mesh, [Replicate()]).redistribute(
            mesh, [Shard(1)]
        )
        dropped = F.dropout(sharded, 0.3).full_tensor()
        after = torch.randn(rows, 3)
    return dropped, after


@pytest.mark.parametrize("start", [0, 2, 6])
def test_a_dtensor_in_a_piece_draws_its_rows_of_the_whole_batchs_values(start):
    rows = 2
    x = torch.randn(TOTAL, SEQUENCE * 2, HIDDEN, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(SEED)
    expected_dropped = F.dropout(x, 0.3)
    expected_after = torch.randn(TOTAL, 3)
    for dropped, after in run_on_ranks(sequence_parallel_dropout_on_ranks, 2, args=(start, rows)):
        assert torch.equal(dropped, expected_dropped[start : start + rows])
        assert torch.equal(after, expected_after[start : start + rows])


def sequence_first_dtensor_dropout_on_ranks(start: int, rows: int, layout: tuple) -> torch.Tensor:
    """Dropout of a (SEQUENCE * 2, rows, HIDDEN) activation sharded on its sequence; full values."""
    manual_seed(SEED)
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), (dist.get_world_size(),))
    x = torch.randn(SEQUENCE * 2, TOTAL, HIDDEN, generator=torch.Generator().manual_seed(0))
    with batch_piece_random(BatchPiece(start, rows, TOTAL, layout)):
        sharded = DTensor.from_local(x[:, start : start + rows], mesh, [Replicate()]).redistribute(
            mesh, [Shard(0)]
        )
        return F.dropout(sharded, 0.3).full_tensor()


@pytest.mark.parametrize("rows", [1, 2])
def test_a_sequence_first_dtensor_in_a_piece_draws_its_rows(rows):
    x = torch.randn(SEQUENCE * 2, TOTAL, HIDDEN, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(SEED)
    expected = F.dropout(x, 0.3)
    start = 3
    for dropped in run_on_ranks(sequence_first_dtensor_dropout_on_ranks, 2, args=(start, rows, ((3, 1),))):
        assert torch.equal(dropped, expected[:, start : start + rows])


@pytest.mark.parametrize("explicit_generator", [True, False])
def test_a_factory_given_a_generator_argument_draws_its_rows(explicit_generator):
    # aten.randn.generator takes its generator (None included) as a required keyword: local
    # execution's trials draw their stand-ins so, and used to fail inside a piece.
    generator = torch.Generator().manual_seed(7) if explicit_generator else None
    torch.manual_seed(7)
    with batch_piece_random(BatchPiece(start=2, rows=2, total=8)):
        rows = torch.ops.aten.randn.generator([2, 3], generator=generator)
    torch.manual_seed(7)
    assert torch.equal(rows, torch.randn(8, 3)[2:4])
