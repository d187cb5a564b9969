"""Save-side and state-side misuse: typed errors that name the tensor or key and the fix,
raised on every rank at once (no rank is left waiting in a collective), and nothing committed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

from vescale.dcheckpoint import CheckpointFormatError, CheckpointMismatchError, load, save
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.testing import run_on_ranks


class Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def _error_text(attempt) -> str:
    try:
        attempt()
    except (CheckpointFormatError, CheckpointMismatchError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def misuse_on_ranks(directory: str) -> dict[str, str]:
    mesh = init_device_mesh(device_type_for_backend(dist.get_backend()), (dist.get_world_size(),))
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    # Ranks may hold different tensors (pipeline stages), but one name has one global shape.
    other_shape = torch.ones(4 if dist.get_rank() == 1 else 3)
    return {
        "partial": _error_text(lambda: save(f"{directory}/partial", {"model": Holder({"summed": partial})})),
        "structure": _error_text(
            lambda: save(f"{directory}/structure", {"model": Holder({"w": other_shape})})
        ),
    }


def test_partial_tensors_and_ranks_with_other_shapes_of_a_tensor_are_refused_on_every_rank(tmp_path):
    for messages in run_on_ranks(misuse_on_ranks, 2, args=(str(tmp_path),)):
        assert messages["partial"].startswith("CheckpointFormatError: 'model/summed' has a Partial placement")
        assert "Redistribute it to Replicate" in messages["partial"]
        assert messages["structure"] == (
            "CheckpointMismatchError: 'model/w' has shape (3,) and dtype float32 on rank 0 but shape (4,) "
            "and dtype float32 on rank 1; every rank that holds a tensor must hold it with the same global "
            "shape and dtype"
        )
    assert not any(path.name in ("partial", "structure") for path in tmp_path.iterdir())


def test_state_that_is_neither_tensor_nor_json_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointFormatError, match=r"cannot save 'extras/handle': a object .* no pickle"):
        save(tmp_path / "ckpt", {"extras": {"handle": object()}})
    with pytest.raises(
        CheckpointFormatError, match=r"state key 'a/b' must be a non-empty string without '/'"
    ):
        save(tmp_path / "ckpt", {"a/b": 1})


def test_optimizer_needs_its_model_and_the_same_parameters(tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with pytest.raises(CheckpointFormatError, match=r"put the module it optimizes in state\[\"model\"\]"):
        save(tmp_path / "ckpt", {"optimizer": optimizer})
    save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})

    weight_only = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(
        CheckpointMismatchError, match=r"optimizer parameters differ.*missing none; unexpected 'bias'"
    ):
        load(tmp_path / "ckpt", {"model": model, "optimizer": weight_only})
    with pytest.raises(
        CheckpointMismatchError, match=r"state\['optimizer'\] is of kind 'value' but the checkpoint"
    ):
        load(tmp_path / "ckpt", {"model": model, "optimizer": 3})
