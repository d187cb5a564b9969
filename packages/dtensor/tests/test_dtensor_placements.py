"""InterleavedShard as a value, the short string form of placements, and the private-API guard.

Single process: nothing here needs a process group. Multi-rank behaviour is in
test_dtensor_interleaved.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.tensor.placement_types as placement_types
from torch.distributed.tensor import Partial, Replicate, Shard

from vescale.dtensor import _compat
from vescale.dtensor.errors import DTensorError
from vescale.dtensor.placements import (
    InterleavedShard,
    PlacementError,
    placement_from_string,
    placement_to_string,
    to_torch_placements,
    to_vescale_placements,
)


@pytest.mark.parametrize(
    ("text", "placement"),
    [
        ("R", Replicate()),
        ("P", Partial()),
        ("P(avg)", Partial("avg")),
        ("P(max)", Partial("max")),
        ("S(0)", Shard(0)),
        ("S(-1)", Shard(-1)),
        ("IS(0,3)", InterleavedShard(0, 3)),
        ("IS(-1,2)", InterleavedShard(-1, 2)),
    ],
)
def test_short_string_round_trips_every_placement(text, placement):
    assert placement_from_string(text) == placement
    assert placement_to_string(placement) == text
    assert placement_from_string(json.loads(json.dumps(placement_to_string(placement)))) == placement


def test_short_string_ignores_whitespace():
    assert placement_from_string(" IS( 1 , 4 ) ") == InterleavedShard(1, 4)
    assert placement_from_string("S( 2 )") == Shard(2)


def test_strided_shard_writes_as_interleaved_shard():
    strided = _compat.strided_shard_type()(1, split_factor=3)
    assert placement_to_string(strided) == "IS(1,3)"


@pytest.mark.parametrize("text", ["", "S", "S(x)", "IS(0)", "IS(0,-3)", "Shard(0)", "r", "P(", "IS(0,3)x"])
def test_unparseable_strings_raise_placement_error_listing_the_valid_forms(text):
    with pytest.raises(PlacementError, match=r"cannot parse placement .*\"IS\(<dim>,<interleaved_size>\)\""):
        placement_from_string(text)


def test_placement_error_is_a_dtensor_error_and_a_value_error():
    assert issubclass(PlacementError, DTensorError)
    assert issubclass(PlacementError, ValueError)


def test_placement_without_short_form_is_named_in_the_error():
    mask_partial = placement_types._MaskPartial()
    with pytest.raises(PlacementError, match="_MaskPartial"):
        placement_to_string(mask_partial)


def test_interleaved_shard_is_a_frozen_hashable_value():
    placement = InterleavedShard(dim=0, interleaved_size=3)
    assert placement == InterleavedShard(0, 3)
    assert len({placement, InterleavedShard(0, 3), InterleavedShard(0, 2)}) == 2
    with pytest.raises(AttributeError):
        placement.dim = 1  # type: ignore[misc]
    assert str(placement) == "IS(0,3)"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((0, 0), "interleaved_size is the number of fused parts and must be at least 1"),
        ((0, 1.5), "interleaved_size must be an int"),
        (("0", 3), "dim must be an int"),
        ((0, True), "interleaved_size must be an int"),
    ],
)
def test_invalid_interleaved_shard_arguments_raise(arguments, message):
    with pytest.raises(PlacementError, match=message):
        InterleavedShard(*arguments)


def test_interleaved_size_not_dividing_the_dim_names_dim_size_and_fix():
    with pytest.raises(PlacementError) as raised:
        InterleavedShard(1, 3).check_shape((4, 10))
    message = str(raised.value)
    assert "tensor dim 1 of size 10" in message
    assert "interleaved_size 3" in message
    assert "(4, 10)" in message
    assert "Shard(1)" in message and "number of equal fused parts" in message


def test_dim_out_of_range_names_the_shape():
    with pytest.raises(PlacementError, match=r"names tensor dim 2, but the tensor has shape \(6,\)"):
        InterleavedShard(2, 3).check_shape((6,))


def reference_interleaved_shards(tensor: torch.Tensor, dim: int, parts: int, num_chunks: int) -> list:
    """Rank r holds chunk r of every part, written out index by index."""
    part_size = tensor.size(dim) // parts
    shards = []
    for rank in range(num_chunks):
        chunk_size = -(-part_size // num_chunks)
        start, stop = min(rank * chunk_size, part_size), min((rank + 1) * chunk_size, part_size)
        indices = [part * part_size + i for part in range(parts) for i in range(start, stop)]
        shards.append(tensor.index_select(dim, torch.tensor(indices, dtype=torch.long)))
    return shards


@pytest.mark.parametrize(
    ("shape", "dim", "parts", "num_chunks"),
    [
        ((6, 2), 0, 3, 2),
        ((2, 12), 1, 3, 4),
        ((9,), 0, 3, 2),
        ((15, 1), 0, 3, 4),
        ((6,), 0, 3, 4),
        ((8, 4), -2, 2, 4),
    ],
)
def test_split_tensor_gives_each_rank_its_slice_of_every_part(shape, dim, parts, num_chunks):
    tensor = torch.arange(torch.Size(shape).numel()).reshape(shape)
    shards = InterleavedShard(dim, parts).split_tensor(tensor, num_chunks)
    expected = reference_interleaved_shards(tensor, dim % len(shape), parts, num_chunks)
    assert len(shards) == num_chunks
    for shard, reference in zip(shards, expected, strict=True):
        assert torch.equal(shard, reference)


def test_split_tensor_of_the_gpt2_layout_is_q_k_v_slices():
    q, k, v = torch.arange(4), torch.arange(10, 14), torch.arange(20, 24)
    shards = InterleavedShard(0, 3).split_tensor(torch.cat([q, k, v]), num_chunks=2)
    assert shards[0].tolist() == [0, 1, 10, 11, 20, 21]
    assert shards[1].tolist() == [2, 3, 12, 13, 22, 23]


def test_torch_conversion_round_trips_through_strided_shard():
    strided_shard = _compat.strided_shard_type()
    torch_placements = to_torch_placements(["R", InterleavedShard(0, 3), "IS(1,2)", Shard(1), "P"])
    assert isinstance(torch_placements[1], strided_shard)
    assert (torch_placements[1].dim, torch_placements[1].split_factor) == (0, 3)
    assert to_vescale_placements(torch_placements) == (
        Replicate(),
        InterleavedShard(0, 3),
        InterleavedShard(1, 2),
        Shard(1),
        Partial(),
    )


def test_single_part_converts_to_plain_shard():
    assert InterleavedShard(1, 1).to_torch() == Shard(1)


def test_non_placement_is_rejected_by_name():
    with pytest.raises(PlacementError, match="'not a placement object' is not a placement"):
        to_torch_placements(
            [object.__new__(type("Odd", (), {"__repr__": lambda self: "'not a placement object'"}))]
        )


# --- the private PyTorch API this feature rests on ----------------------------------------


def test_strided_shard_exists_with_the_semantics_interleaved_shard_relies_on():
    strided = _compat.strided_shard_type()(0, split_factor=3)
    assert strided.dim == 0 and strided.split_factor == 3
    tensor = torch.arange(15)
    shards, _ = strided._split_tensor(tensor, 4, with_padding=False)
    for shard, reference in zip(shards, reference_interleaved_shards(tensor, 0, 3, 4), strict=True):
        assert torch.equal(shard, reference)


def test_missing_strided_shard_raises_private_torch_api_error(monkeypatch):
    monkeypatch.delattr(placement_types, "_StridedShard")
    with pytest.raises(_compat.PrivateTorchAPIError, match=r"placement_types\._StridedShard does not exist"):
        _compat.strided_shard_type()
    with pytest.raises(_compat.PrivateTorchAPIError):
        InterleavedShard(0, 3).to_torch()


def test_strided_shard_without_split_factor_raises_private_torch_api_error(monkeypatch):
    monkeypatch.setattr(placement_types, "_StridedShard", type("_StridedShard", (), {}))
    with pytest.raises(_compat.PrivateTorchAPIError, match="no split_factor property"):
        _compat.strided_shard_type()
