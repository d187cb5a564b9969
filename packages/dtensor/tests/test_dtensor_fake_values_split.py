"""FakeValuePolicy keeps counts read from tensors without data consistent with a split (issue #18).

JetMoE reads its per-expert token counts with ``tolist()`` and splits the routed tokens by them.
Each count reads 0 on fake tensors, and ``split([0, 0, 0, 0])`` of 128 tokens failed; once a
value has been answered, a split whose sizes do not fill the dimension splits it evenly.
"""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor import _compat
from vescale.dtensor.deferred.fake_values import FakeValuePolicy


def _routed(tokens: int, experts: int) -> torch.Tensor:
    return torch.zeros(tokens, experts, dtype=torch.long).sum(0)


def test_a_split_by_counts_read_from_fake_tensors_splits_the_tokens_evenly():
    with _compat.fake_tensor_mode_class()() as fake, FakeValuePolicy() as values:
        tokens = fake.from_tensor(torch.zeros(10, 3))
        counts = fake.from_tensor(_routed(10, 4)).tolist()
        assert counts == [0, 0, 0, 0]
        pieces = tokens.split(counts, dim=0)
    assert [piece.shape[0] for piece in pieces] == [3, 3, 2, 2]
    assert values.guessed_shapes == 1


def test_a_split_that_does_not_add_up_without_a_read_value_stays_an_error():
    with _compat.fake_tensor_mode_class()() as fake, FakeValuePolicy():
        tokens = fake.from_tensor(torch.zeros(10, 3))
        with pytest.raises(RuntimeError, match="split_with_sizes"):
            tokens.split([1, 1], dim=0)


def test_real_tensors_are_split_as_asked():
    with FakeValuePolicy():
        assert torch.zeros(4).sum().item() == 0
        with pytest.raises(RuntimeError, match="split_with_sizes"):
            torch.zeros(10, 3).split([1, 1], dim=0)


def split_of_a_fake_dtensor_on_rank() -> list[int]:
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    with _compat.fake_tensor_mode_class()() as fake, FakeValuePolicy():
        tokens = DTensor.from_local(fake.from_tensor(torch.zeros(10, 3)), mesh, [Replicate()])
        counts = fake.from_tensor(_routed(10, 4)).tolist()
        pieces = tokens.split(counts, dim=0)
    return [piece.shape[0] for piece in pieces]


def test_a_tensor_parallel_models_split_by_read_counts_splits_evenly_too():
    # JetMoE under pp2 x tp2: dpipe's pass runs on DTensors whose local tensors are fake.
    from vescale.dtensor.testing import run_on_ranks

    assert run_on_ranks(split_of_a_fake_dtensor_on_rank, 1)[0] == [3, 3, 2, 2]
