"""``DistributedDataLoader`` on gloo ranks against ``torch.utils.data.DataLoader`` in one process.

The compared quantity is the global batch of every step: the concatenation, in dp-rank order,
of what the dp ranks yield, against the batch torch's ``DataLoader`` yields for
``batch_size=global_batch_size`` over the same sample order. Loading only moves values (no
arithmetic), so every comparison is bitwise. With ``shuffle=True`` the documented order of
epoch ``e`` is ``torch.randperm(len(dataset))`` seeded with ``seed + e``; the reference feeds
that order to torch's ``DataLoader`` as its sampler.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from vescale.api.data_loader import DataLoaderConfigError, DataLoaderStateError, DistributedDataLoader
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

SEQ_LEN = 3


class TokenDataset(Dataset):
    """Sample ``i``: a dict of a distinct token row and its label, like a tokenized corpus."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.arange(index * SEQ_LEN, (index + 1) * SEQ_LEN)
        return {"input_ids": tokens, "labels": tokens + 1000}


class TokenStream(IterableDataset):
    """The same samples as a stream without an index."""

    def __init__(self, num_samples: int) -> None:
        self.samples = TokenDataset(num_samples)

    def __iter__(self):
        return (self.samples[index] for index in range(len(self.samples)))


def _dataset(kind: str, num_samples: int) -> Dataset:
    return TokenDataset(num_samples) if kind == "map" else TokenStream(num_samples)


def _reference_epoch(kind: str, num_samples: int, batch_size: int, order: list[int] | None, drop_last: bool):
    """Torch's global batches of one epoch; ``order`` (a sampler) is the epoch's shuffled order."""
    dataset = _dataset(kind, num_samples)
    return list(DataLoader(dataset, batch_size=batch_size, sampler=order, drop_last=drop_last))


def _cat_dp_slices(per_rank_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([batch[key] for batch in per_rank_batches]) for key in per_rank_batches[0]}


def _assert_batches_equal(actual: list[dict], expected: list[dict]) -> None:
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got.keys() == want.keys(), step
        for key in want:
            assert torch.equal(got[key], want[key]), (step, key, got[key], want[key])


# --- functions that run on the ranks (module level: ranks look them up by name) ---


def _one_epoch(kind: str, num_samples: int, global_batch: int, drop_last: bool, shuffle: bool, seed: int):
    mesh = init_mesh(dp=2, tp=2)
    loader = DistributedDataLoader(
        _dataset(kind, num_samples),
        mesh,
        global_batch_size=global_batch,
        drop_last=drop_last,
        shuffle=shuffle,
        seed=seed,
    )
    batches = list(loader)
    length = len(loader) if kind == "map" else None
    return mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), batches, length, loader.state_dict()


def _consume(kind: str, dp: int, state_json: str | None, steps: int, shuffle: bool):
    """Load ``state_json`` (if any), take ``steps`` batches across epochs, return them and the state."""
    mesh = init_mesh(dp=dp)
    loader = DistributedDataLoader(_dataset(kind, 10), mesh, global_batch_size=4, shuffle=shuffle, seed=7)
    if state_json is not None:
        loader.load_state_dict(json.loads(state_json))
    batches = []
    while len(batches) < steps:
        for batch in loader:
            batches.append(batch)
            if len(batches) == steps:
                break
    return batches, json.dumps(loader.state_dict())


# --- tests ---


@pytest.mark.parametrize(
    ("kind", "num_samples", "drop_last"),
    [("map", 12, True), ("map", 14, True), ("map", 14, False), ("stream", 14, False), ("stream", 13, True)],
)
def test_dp_slices_concatenate_to_torch_dataloader_batches_and_tp_ranks_agree(kind, num_samples, drop_last):
    global_batch = 4
    args = (kind, num_samples, global_batch, drop_last, False, 0)
    results = run_on_ranks(_one_epoch, world_size=4, args=args)
    expected = _reference_epoch(kind, num_samples, global_batch, None, drop_last)
    by_rank = {(dp_rank, tp_rank): batches for dp_rank, tp_rank, batches, _, _ in results}
    for tp_rank in range(2):
        _assert_batches_equal(by_rank[(0, tp_rank)], by_rank[(0, 0)])
        _assert_batches_equal(by_rank[(1, tp_rank)], by_rank[(1, 0)])
    assert all(len(batch["input_ids"]) == global_batch // 2 for batch in by_rank[(0, 0)][: num_samples // 4])
    global_batches = [_cat_dp_slices(pair) for pair in zip(by_rank[(0, 0)], by_rank[(1, 0)], strict=True)]
    _assert_batches_equal(global_batches, expected)
    for _, _, _, length, state in results:
        if kind == "map":
            assert length == len(DataLoader(_dataset(kind, num_samples), batch_size=4, drop_last=drop_last))
        assert (state["epoch"], state["batches_consumed"]) == (1, 0)


def test_shuffle_is_the_seeded_permutation_of_each_epoch_on_every_rank():
    num_samples, global_batch, seed = 12, 4, 5
    results = run_on_ranks(_one_epoch, 4, args=("map", num_samples, global_batch, True, True, seed))
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    assert order != sorted(order)
    expected = _reference_epoch("map", num_samples, global_batch, order, True)
    by_rank = {(dp_rank, tp_rank): batches for dp_rank, tp_rank, batches, _, _ in results}
    _assert_batches_equal(by_rank[(0, 1)], by_rank[(0, 0)])
    global_batches = [_cat_dp_slices(pair) for pair in zip(by_rank[(0, 0)], by_rank[(1, 0)], strict=True)]
    _assert_batches_equal(global_batches, expected)
    other_seed = run_on_ranks(_one_epoch, 4, args=("map", num_samples, global_batch, True, True, 6))
    assert not torch.equal(other_seed[0][2][0]["input_ids"], by_rank[(0, 0)][0]["input_ids"])


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_resume_mid_epoch_under_dp2_then_dp4_continues_the_global_sequence(kind):
    # 10 samples, global batch 4, drop_last: 2 batches per epoch. 3 steps under dp=2 end one batch
    # into epoch 1; dp=4 then takes 3 more: the rest of epoch 1 and all of epoch 2.
    shuffle = kind == "map"
    first = run_on_ranks(_consume, world_size=2, args=(kind, 2, None, 3, shuffle))
    state_json = first[0][1]
    assert all(state == state_json for _, state in first)
    saved = json.loads(state_json)
    assert (saved["epoch"], saved["batches_consumed"], saved["dp_size"]) == (1, 1, 2)
    second = run_on_ranks(_consume, world_size=4, args=(kind, 4, state_json, 3, shuffle))
    sequence = [_cat_dp_slices([rank[0][step] for rank in first]) for step in range(3)]
    sequence += [_cat_dp_slices([rank[0][step] for rank in second]) for step in range(3)]
    expected = []
    for epoch in range(3):
        order = None
        if shuffle:
            order = torch.randperm(10, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        expected += _reference_epoch(kind, 10, 4, order, drop_last=True)
    _assert_batches_equal(sequence, expected[:6])
    # The last batch taken ends epoch 2, so the saved position is already epoch 3's start.
    for _, state in second:
        assert (json.loads(state)["epoch"], json.loads(state)["batches_consumed"]) == (3, 0)


def _generator_after_each_epoch_start(resume_mid_epoch: bool) -> list[torch.Tensor]:
    """The default generator's state right after ``iter(loader)`` of two epochs (resumed one
    batch into the first, if asked: the rest of that epoch, then the next one)."""
    mesh = init_mesh(dp=2)
    loader = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=4)
    if resume_mid_epoch:
        next(iter(loader))
        saved = loader.state_dict()
        loader = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=4)
        loader.load_state_dict(saved)
    torch.manual_seed(0)
    states = []
    for _ in range(2):
        batches = iter(loader)
        states.append(torch.get_rng_state())
        list(batches)
    return states


def test_an_epoch_start_draws_from_the_default_generator_as_torch_dataloader_does():
    # A model's dropout after iter(loader) must draw what the single-device loop over torch's
    # DataLoader draws; torch's iter() draws one number (its workers' base seed).
    torch.manual_seed(0)
    expected = []
    for _ in range(2):
        batches = iter(DataLoader(TokenDataset(8), batch_size=4))
        expected.append(torch.get_rng_state())
        list(batches)
    assert not torch.equal(expected[0], torch.manual_seed(0).get_state())
    for states in run_on_ranks(_generator_after_each_epoch_start, world_size=2, args=(False,)):
        assert all(torch.equal(got, want) for got, want in zip(states, expected, strict=True))
    # Resumed one batch into an epoch: the uninterrupted loop draws nothing there, so neither does
    # the resumed one; the next epoch's start draws one number.
    for states in run_on_ranks(_generator_after_each_epoch_start, world_size=2, args=(True,)):
        assert torch.equal(states[0], torch.manual_seed(0).get_state())
        assert torch.equal(states[1], expected[0])


def _error_case(case: str) -> None:
    mesh = init_mesh(dp=2)
    if case == "indivisible_global_batch":
        with pytest.raises(DataLoaderConfigError, match=r"global_batch_size=5 does not split into 2 .*'dp'"):
            DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=5)
    elif case == "unknown_dp_dim":
        with pytest.raises(DataLoaderConfigError, match=r"dp_dim='data' is not a dimension .*\['dp'\]"):
            DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=4, dp_dim="data")
    elif case == "bad_global_batch":
        with pytest.raises(DataLoaderConfigError, match="must be a positive integer, got 0"):
            DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=0)
    elif case == "shuffle_stream":
        with pytest.raises(DataLoaderConfigError, match="shuffle=True needs a map-style dataset"):
            DistributedDataLoader(TokenStream(8), mesh, global_batch_size=4, shuffle=True)
    elif case == "not_a_dataset":
        with pytest.raises(DataLoaderConfigError, match="the dataset \\(a int\\) has neither"):
            DistributedDataLoader(3, mesh, global_batch_size=4)
    elif case == "uneven_last_batch":
        with pytest.raises(DataLoaderConfigError, match=r"batch of 3 samples, .* 2 equal dp slices"):
            DistributedDataLoader(TokenDataset(7), mesh, global_batch_size=4, drop_last=False)
    elif case == "uneven_last_batch_of_stream":
        loader = DistributedDataLoader(TokenStream(7), mesh, global_batch_size=4, drop_last=False)
        with pytest.raises(DataLoaderConfigError, match="last global batch of 3 samples"):
            list(loader)
    elif case == "stream_without_length":
        with pytest.raises(TypeError, match="has no __len__"):
            len(DistributedDataLoader(TokenStream(8), mesh, global_batch_size=4))
    elif case == "other_global_batch_on_load":
        saved = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=4).state_dict()
        loader = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=8)
        with pytest.raises(DataLoaderStateError, match="size=4, this loader global_batch_size=8"):
            loader.load_state_dict(saved)
    elif case == "other_seed_on_load":
        saved = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=4, shuffle=True).state_dict()
        loader = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=4, shuffle=True, seed=1)
        with pytest.raises(DataLoaderStateError, match=r"seed=0, this loader seed=1.*with seed=0"):
            loader.load_state_dict(saved)
    elif case == "not_a_loader_state":
        loader = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=4)
        with pytest.raises(DataLoaderStateError, match="not a DistributedDataLoader state"):
            loader.load_state_dict({"epoch": 0})
    elif case == "load_while_iterating":
        loader = DistributedDataLoader(TokenDataset(8), mesh, global_batch_size=2)
        saved = loader.state_dict()
        iterator = iter(loader)
        next(iterator)
        loader.load_state_dict(saved)
        with pytest.raises(DataLoaderStateError, match="moved the loader while this iterator was running"):
            next(iterator)
    else:
        raise AssertionError(case)


ERROR_CASES = (
    "indivisible_global_batch",
    "unknown_dp_dim",
    "bad_global_batch",
    "shuffle_stream",
    "not_a_dataset",
    "uneven_last_batch",
    "uneven_last_batch_of_stream",
    "stream_without_length",
    "other_global_batch_on_load",
    "other_seed_on_load",
    "not_a_loader_state",
    "load_while_iterating",
)


def _error_cases() -> list[str]:
    for case in ERROR_CASES:
        _error_case(case)
    return list(ERROR_CASES)


def test_errors_name_the_problem_and_the_fix():
    # One run for all cases: each run waits its turn for the machine's ranks.
    assert run_on_ranks(_error_cases, world_size=2) == [list(ERROR_CASES)] * 2
