"""vescale.dmodule.deferred_init, the user-facing entry, against eager construction.

Compared bitwise: materialisation replays eager construction's own ops on full tensors
with its generator states, and cutting a shard only moves values.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import vescale.dmodule
from vescale.dmodule.deferred import NotDeferredError, is_deferred, materialize_module
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models import NanoGPT, NanoGPTConfig

SEED = 7
CONFIG = NanoGPTConfig(vocab_size=63)


def eager_parameters() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return {fqn: value.detach().clone() for fqn, value in NanoGPT(CONFIG).named_parameters()}


def test_dmodule_deferred_init_is_the_function_and_defers_every_parameter():
    torch.manual_seed(SEED)
    model = vescale.dmodule.deferred_init(NanoGPT, CONFIG)
    assert all(is_deferred(parameter) for parameter in model.parameters())
    vescale.dmodule.materialize_module(model)
    expected = eager_parameters()
    assert all(torch.equal(value, expected[fqn]) for fqn, value in model.named_parameters())
    with pytest.raises(NotDeferredError, match="deferred_init"):
        materialize_module(NanoGPT(CONFIG))


def shard_linear_weights_on_ranks():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(SEED)
    model = vescale.dmodule.deferred_init(NanoGPT, CONFIG)
    materialize_module(model, lambda fqn: (mesh, [Shard(0)]) if fqn.endswith("weight") else None)
    return {
        fqn: (
            isinstance(value, DTensor),
            (value.full_tensor() if isinstance(value, DTensor) else value).detach(),
        )
        for fqn, value in model.named_parameters()
    }


def test_two_ranks_hold_shard0_weights_whose_full_tensors_are_the_eager_ones():
    expected = eager_parameters()
    for parameters in run_on_ranks(shard_linear_weights_on_ranks, 2):
        assert sorted(parameters) == sorted(expected)
        for fqn, (is_dtensor, full) in parameters.items():
            assert is_dtensor == fqn.endswith("weight")
            assert torch.equal(full, expected[fqn]), fqn
