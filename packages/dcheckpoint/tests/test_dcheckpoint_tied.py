"""A tied tensor is saved once and loads into tied and untied models alike.

GPT-2, Gemma and OPT hold one tensor as their input embedding and their output projection;
``state_dict`` lists it under both names, and a checkpoint wrote it twice. It is now written
under its first name with the other recorded as an alias: loading fills a tied model's one
tensor, and both tensors of a model built untied.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vescale.dcheckpoint import load, save
from vescale.dcheckpoint.api import read_index
from vescale.dcheckpoint.atomic import resolve_checkpoint
from vescale.dcheckpoint.state import tied_aliases
from vescale.dtensor.testing import run_on_ranks


class TinyLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def save_and_load_on_rank(path: str) -> dict:
    torch.manual_seed(0)
    saved = TinyLM(tied=True)
    save(path, {"model": saved})
    tied, untied = TinyLM(tied=True), TinyLM(tied=False)
    for model in (tied, untied):
        for parameter in model.parameters():
            nn.init.zeros_(parameter)
        load(path, {"model": model})  # strict: every saved name and alias is used
    return {
        "tied keeps one tensor": tied.head.weight is tied.embed.weight,
        "tied values": torch.equal(tied.embed.weight, saved.embed.weight),
        "untied embedding": torch.equal(untied.embed.weight, saved.embed.weight),
        "untied head": torch.equal(untied.head.weight, saved.embed.weight),
        "norm": torch.equal(untied.norm.weight, saved.norm.weight),
    }


def test_a_tied_tensor_is_saved_once_and_loads_into_tied_and_untied_models(tmp_path):
    path = str(tmp_path / "tied")
    for rank, checks in enumerate(run_on_ranks(save_and_load_on_rank, 2, args=(path,))):
        assert all(checks.values()), (rank, checks)
    index = read_index(resolve_checkpoint(Path(path)))
    assert sorted(name for name in index.tensors if name.startswith("model/")) == [
        "model/embed.weight",
        "model/norm.bias",
        "model/norm.weight",
    ]
    assert index.objects["model"]["value"] == {"aliases": {"head.weight": "embed.weight"}}
    assert tied_aliases(TinyLM(tied=False)) == {}
