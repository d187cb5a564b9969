"""``model_state_kept``: a forward run for planning leaves the model and the generators as they were.

Reference: a fresh copy of the same model, never run, and the generator state before the run.
The model's forward does what ``transformers`` models do in a first forward (BigBird swaps a
submodule for a new one built with ``nn.Linear``, which draws; an attribute flips; BatchNorm
updates its statistics; a cache buffer is registered).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vescale.dtensor.model_state import buffers_kept, model_state_kept


class SwapsOnFirstForward(nn.Module):
    """Swaps ``self.attention`` for a new module on its first forward, as BigBird does."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "sparse"
        self.attention = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "sparse":
            self.mode = "full"
            shared = self.attention
            self.attention = nn.Sequential(nn.Linear(4, 4))  # a new module: its init draws
            self.attention[0] = shared
            self.register_buffer("cache", torch.ones(4))
        return torch.nn.functional.dropout(self.norm(self.attention(x)), 0.5)


def _state(model: nn.Module) -> dict[str, object]:
    return {
        "structure": [(name, type(module).__name__) for name, module in model.named_modules()],
        "mode": model.mode,
        "buffers": {name: buffer.clone() for name, buffer in model.named_buffers()},
    }


def test_a_forward_under_it_changes_nothing_a_later_forward_sees():
    torch.manual_seed(0)
    model = SwapsOnFirstForward()
    untouched = copy.deepcopy(model)
    before, generator = _state(model), torch.get_rng_state()
    attention = model.attention

    with model_state_kept(model):
        model(torch.randn(3, 4))
        assert model.mode == "full" and isinstance(model.attention, nn.Sequential)  # it did run

    after = _state(model)
    assert after["structure"] == before["structure"] and after["mode"] == "sparse"
    assert model.attention is attention and "cache" not in dict(model.named_buffers())
    assert after["buffers"].keys() == before["buffers"].keys()
    for name, value in before["buffers"].items():
        assert torch.equal(after["buffers"][name], value), name
    assert torch.equal(torch.get_rng_state(), generator)
    # The next forward is the first one a single device runs: the same output, the same draws.
    torch.manual_seed(1)
    expected = untouched(torch.ones(3, 4))
    torch.manual_seed(1)
    assert torch.equal(model(torch.ones(3, 4)), expected)
    assert torch.equal(model.norm.running_mean, untouched.norm.running_mean)


def test_a_forward_that_raises_is_undone_too():
    model = SwapsOnFirstForward()
    running_mean = model.norm.running_mean.clone()
    with pytest.raises(RuntimeError, match="stop"), model_state_kept(model):
        model(torch.randn(3, 4))
        raise RuntimeError("stop")
    assert model.mode == "sparse" and isinstance(model.attention, nn.Linear)
    assert torch.equal(model.norm.running_mean, running_mean)


def test_meta_buffers_are_left_alone():
    with torch.device("meta"):
        model = SwapsOnFirstForward()
    with model_state_kept(model):
        model(torch.empty(3, 4, device="meta"))
    assert model.mode == "sparse" and model.norm.running_mean.is_meta


def test_buffers_kept_puts_back_buffer_values_and_leaves_the_structure():
    """What a probe forward of a parallelized model runs under: FSDP2's and local execution's own
    changes to the modules stay, BatchNorm's statistics do not."""
    model = SwapsOnFirstForward()
    running_mean = model.norm.running_mean.clone()
    with torch.no_grad(), buffers_kept(model):
        model(torch.randn(3, 4))
    assert model.mode == "full" and isinstance(model.attention, nn.Sequential)
    assert torch.equal(model.norm.running_mean, running_mean)


def dtensor_buffer_after_a_kept_forward() -> torch.Tensor:
    from torch.distributed.tensor import Replicate, distribute_tensor

    from vescale.dtensor import init_mesh

    mesh = init_mesh(tp=2)
    model = nn.BatchNorm1d(4)
    model.running_mean = distribute_tensor(torch.zeros(4), mesh, [Replicate()])
    with torch.no_grad(), buffers_kept(model):
        model.running_mean.add_(1.0)  # as BatchNorm's forward updates it
    return model.running_mean.to_local()


def test_a_dtensor_buffer_gets_its_local_values_back():
    from vescale.dtensor.testing import run_on_ranks

    for values in run_on_ranks(dtensor_buffer_after_a_kept_forward, world_size=2):
        assert torch.equal(values, torch.zeros(4))
