"""The on-disk format: stock safetensors shards, a checksummed JSON index, no pickle, and
typed errors for every kind of damaged, forged or mismatched input.

Loaded values are compared bitwise with what was saved: loading only moves bytes.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from vescale.dcheckpoint.api import load, read_index, save
from vescale.dcheckpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
)
from vescale.dcheckpoint.index import encode_index


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 5)
        self.register_buffer("counts", torch.arange(4, dtype=torch.int64))
        self.register_buffer("halves", torch.linspace(0, 1, 3, dtype=torch.bfloat16))


def _saved(tmp_path: Path) -> tuple[Path, SmallNet]:
    torch.manual_seed(0)
    model = SmallNet()
    save(tmp_path / "ckpt", {"model": model, "step": 5})
    return tmp_path / "ckpt", model


def _assert_loads_equal(directory: Path, model: SmallNet) -> None:
    fresh = SmallNet()
    load(directory, {"model": fresh, "step": 0})
    for (name, saved), loaded in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(saved, loaded), name


def _assert_load_refused(directory, match: str) -> None:
    """Loading ``directory`` into a fresh SmallNet raises CheckpointFormatError matching ``match``."""
    with pytest.raises(CheckpointFormatError, match=match):
        load(directory, {"model": SmallNet(), "step": 0})


def test_shards_open_with_stock_safetensors_and_hold_the_saved_tensors(tmp_path):
    directory, model = _saved(tmp_path)
    index = read_index(directory)
    for name, tensor in model.state_dict().items():
        (chunk,) = index.tensors[f"model/{name}"].chunks
        with safe_open(str(directory / chunk.file), "pt") as shard:
            assert torch.equal(shard.get_tensor(chunk.key), tensor), name
    raw = json.loads((directory / "index.json").read_text())
    assert raw["tensors"]["model/proj.weight"]["shape"] == [5, 6]
    assert raw["tensors"]["model/halves"]["dtype"] == "bfloat16"


def test_loading_works_with_pickle_blocked(tmp_path, monkeypatch):
    directory, model = _saved(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used while loading a checkpoint")

    for attribute in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, attribute, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    _assert_loads_equal(directory, model)


def test_saving_over_an_existing_checkpoint_is_refused(tmp_path):
    directory, model = _saved(tmp_path)
    with pytest.raises(
        CheckpointExistsError, match=r"ckpt' already exists; save each checkpoint to a new path"
    ):
        save(directory, {"model": model})


def test_a_missing_checkpoint_says_what_was_expected(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"neither index.json nor a 'latest' pointer"):
        load(tmp_path, {"model": SmallNet()})


def _rewrite_index(directory: Path, edit) -> None:
    body = json.loads((directory / "index.json").read_text())
    for key in ("format", "version", "checksum"):
        body.pop(key)
    edit(body)
    (directory / "index.json").write_bytes(encode_index(body))


@pytest.mark.parametrize("file_name", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_index_file_names_that_escape_the_directory_are_refused(tmp_path, file_name):
    directory, _ = _saved(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes(b"\0" * 64)

    def escape(body):
        body["files"][0]["name"] = file_name

    _rewrite_index(directory, escape)
    _assert_load_refused(directory, r"is not a plain shard file name inside the checkpoint")


def test_a_shard_that_is_a_link_out_of_the_directory_is_refused(tmp_path):
    directory, _ = _saved(tmp_path)
    (shard,) = directory.glob("*.safetensors")
    shard.rename(tmp_path / "moved.safetensors")
    shard.symlink_to(tmp_path / "moved.safetensors")
    _assert_load_refused(directory, rf"'{shard.name}', which lies outside")


def test_forged_byte_ranges_and_shapes_are_refused(tmp_path):
    directory, _ = _saved(tmp_path)
    original_index = (directory / "index.json").read_bytes()

    def past_the_end(body):
        chunk = body["tensors"]["model/proj.weight"]["chunks"][0]
        chunk["byte_range"] = [chunk["byte_range"][0] + 10**6, chunk["byte_range"][1] + 10**6]

    _rewrite_index(directory, past_the_end)
    _assert_load_refused(directory, r"tensor 'model/proj.weight' chunk 0: byte range")

    (directory / "index.json").write_bytes(original_index)

    def hole(body):
        body["tensors"]["model/proj.weight"]["shape"] = [6, 6]

    _rewrite_index(directory, hole)
    _assert_load_refused(directory, r"'model/proj.weight': its chunks do not tile the shape")


def test_truncated_and_corrupted_shards_name_the_file(tmp_path):
    directory, model = _saved(tmp_path)
    (shard,) = directory.glob("*.safetensors")
    original = shard.read_bytes()
    shard.write_bytes(original[:-3])
    _assert_load_refused(directory, rf"'{shard.name}' has {len(original) - 3} bytes where")
    corrupted = bytearray(original)
    corrupted[-1] ^= 0x40
    shard.write_bytes(bytes(corrupted))
    with pytest.raises(
        CheckpointFormatError, match=rf"'{shard.name}' holds data of 'model/.*' whose checksum"
    ):
        load(directory, {"model": SmallNet(), "step": 0})
    shard.write_bytes(original)
    _assert_loads_equal(directory, model)


def _mutate(path: Path, rng: random.Random) -> str:
    raw = bytearray(path.read_bytes())
    kind = rng.choice(["flip", "truncate", "append", "zero-run"])
    position = rng.randrange(len(raw))
    if kind == "flip":
        raw[position] ^= rng.randrange(1, 256)
    elif kind == "truncate":
        del raw[position:]
    elif kind == "append":
        raw += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    else:
        end = min(len(raw), position + rng.randrange(1, 16))
        if all(byte == 0 for byte in raw[position:end]):
            raw[position] = 1
        raw[position:end] = bytes(end - position)
    path.write_bytes(bytes(raw))
    return f"{kind} at {position} of {path.name}"


def test_every_fuzzed_byte_of_index_or_shard_is_detected_and_the_original_stays_loadable(tmp_path):
    directory, model = _saved(tmp_path)
    rng = random.Random(2024)
    for trial in range(150):
        damaged = tmp_path / f"damaged-{trial}"
        shutil.copytree(directory, damaged)
        target = rng.choice(sorted(damaged.iterdir()))
        mutation = _mutate(target, rng)
        with pytest.raises(CheckpointError) as caught:
            load(damaged, {"model": SmallNet(), "step": 0})
        assert isinstance(caught.value, CheckpointFormatError | CheckpointNotFoundError), mutation
        shutil.rmtree(damaged)
    _assert_loads_equal(directory, model)


def test_a_missing_shard_file_is_named(tmp_path):
    directory, _ = _saved(tmp_path)
    (shard,) = directory.glob("*.safetensors")
    os.remove(shard)
    _assert_load_refused(directory, rf"'{shard.name}' is missing")
