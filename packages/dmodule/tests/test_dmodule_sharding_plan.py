"""The sharding plan's forms, JSON round trip, precedence rule and error messages.

These are single-process tests of parsing and matching: no tensor is placed, so there is
no numeric reference; each test states the decision or message it pins down.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from vescale.dmodule.errors import DModuleError, ShardingPlanError
from vescale.dmodule.sharding_plan import ForwardPlacements, ShardingPlan
from vescale.dtensor.placements import InterleavedShard


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.qkv = nn.Linear(8, 24)


class TinyNet(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight


MEGATRON_PLAN = {
    "parameter": {
        r"blocks\.\d+\.fc1\.(weight|bias)": "S(0)",
        r"blocks\.\d+\.fc2\.weight": "S(1)",
        r"blocks\.\d+\.qkv\.weight": "IS(0,3)",
        r"embed\.weight": ["R", "S(0)"],
    },
    "forward": {
        r"blocks\.\d+\.fc1.input": ["R"],
        r"blocks\.\d+.output": [None, "S(1)"],
        r"blocks\.\d+\.fc2.input": {"input": ["R", "P"]},
        "output": ["S(-1)"],
    },
}


def test_plan_round_trips_through_json_exactly():
    plan = ShardingPlan.from_dict(MEGATRON_PLAN)
    assert ShardingPlan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json()) == MEGATRON_PLAN


def test_placement_objects_and_strings_give_the_same_plan():
    from_objects = ShardingPlan.from_dict(
        {"parameter": {r"blocks\.\d+\.qkv\.weight": InterleavedShard(0, 3), r"head\.weight": [Shard(0)]}}
    )
    from_strings = ShardingPlan.from_dict(
        {"parameter": {r"blocks\.\d+\.qkv\.weight": "IS(0, 3)", r"head\.weight": "S(0)"}}
    )
    assert from_objects == from_strings


def test_single_placement_applies_on_the_plan_mesh_dim_and_replicates_elsewhere():
    resolved = ShardingPlan.from_dict(MEGATRON_PLAN).resolve(TinyNet(), mesh_shape=(2, 2), mesh_dim=1)
    assert resolved.parameters["blocks.0.fc1.weight"].placements == (Replicate(), Shard(0))
    assert resolved.parameters["blocks.1.qkv.weight"].placements == (Replicate(), InterleavedShard(0, 3))
    assert resolved.parameters["embed.weight"].placements == (Replicate(), Shard(0))
    assert "blocks.0.fc2.bias" not in resolved.parameters
    fc2_input, pattern = resolved.inputs["blocks.1.fc2"]
    assert fc2_input == ForwardPlacements(kwargs=(("input", (Replicate(), Partial())),))
    assert pattern == r"blocks\.\d+\.fc2"
    assert resolved.outputs[""][0].args == ((Replicate(), Shard(-1)),)
    assert resolved.outputs["blocks.0"][0].args == (None, (Replicate(), Shard(1)))


def test_later_entry_wins_when_patterns_overlap():
    plan = ShardingPlan.from_dict(
        {"parameter": {r"blocks\.\d+\.fc1\.weight": "S(0)", r"blocks\.1\.fc1\.weight": "R"}}
    )
    resolved = plan.resolve(TinyNet(), mesh_shape=(2,), mesh_dim=0)
    assert resolved.parameters["blocks.0.fc1.weight"].placements == (Shard(0),)
    assert resolved.parameters["blocks.1.fc1.weight"].placements == (Replicate(),)
    assert resolved.parameters["blocks.1.fc1.weight"].pattern == r"blocks\.1\.fc1\.weight"


def test_patterns_match_the_whole_fqn():
    plan = ShardingPlan.from_dict({"parameter": {r"fc1\.weight": "S(0)"}})
    with pytest.raises(ShardingPlanError, match=r"matched no parameter; closest: 'blocks\.\d\.fc1\.weight'"):
        plan.resolve(TinyNet(), mesh_shape=(2,), mesh_dim=0)


def test_unknown_plan_key_suggests_the_right_one():
    with pytest.raises(ShardingPlanError, match=r"unknown plan key 'parameters'; did you mean 'parameter'\?"):
        ShardingPlan.from_dict({"parameters": {}})


def test_forward_key_without_input_or_output_says_how_to_write_it():
    with pytest.raises(ShardingPlanError, match=r"'blocks\.0\.fc1' must end in '\.input' or '\.output'"):
        ShardingPlan.from_dict({"forward": {"blocks.0.fc1": ["R"]}})


def test_invalid_regular_expression_is_named():
    with pytest.raises(
        ShardingPlanError, match=re.escape("plan pattern 'blocks\\.(' is not a valid regular expression")
    ):
        ShardingPlan.from_dict({"parameter": {r"blocks\.(": "R"}})


def test_unparseable_placement_names_the_entry():
    with pytest.raises(
        ShardingPlanError, match=r"parameter\['head\\.weight'\]: cannot parse placement 'Shard0'"
    ):
        ShardingPlan.from_dict({"parameter": {r"head\.weight": "Shard0"}})


def test_partial_parameter_is_refused():
    with pytest.raises(ShardingPlanError, match="a parameter cannot be Partial"):
        ShardingPlan.from_dict({"parameter": {r"head\.weight": "P"}})


def test_forward_entry_must_be_a_list_or_dict():
    with pytest.raises(ShardingPlanError, match=r"forward\['head\.input'\]: expected a list"):
        ShardingPlan.from_dict({"forward": {"head.input": "R"}})


def test_module_pattern_matching_nothing_names_the_closest_modules():
    plan = ShardingPlan.from_dict({"forward": {r"block\.\d+\.fc1.input": ["R"]}})
    with pytest.raises(ShardingPlanError, match=r"closest: 'blocks\.\d\.fc1'"):
        plan.resolve(TinyNet(), mesh_shape=(2,), mesh_dim=0)


def test_impossible_shard_dim_names_fqn_shape_and_mesh_dim():
    plan = ShardingPlan.from_dict({"parameter": {r"head\.weight": "S(2)"}})
    with pytest.raises(ShardingPlanError) as raised:
        plan.resolve(TinyNet(), mesh_shape=(4,), mesh_dim=0)
    assert str(raised.value).startswith(
        "parameter 'head.weight' of shape (32, 8) cannot take S(2) on mesh dim 0 (size 4): "
        "tensor dim 2 does not exist"
    )


def test_interleaved_shard_must_cut_equal_parts():
    plan = ShardingPlan.from_dict({"parameter": {r"blocks\.0\.fc1\.weight": "IS(0,3)"}})
    with pytest.raises(ShardingPlanError, match=r"dim 0 of size 16 is not 3 equal fused parts"):
        plan.resolve(TinyNet(), mesh_shape=(2,), mesh_dim=0)


def test_placement_count_must_be_one_or_the_mesh_ndim():
    plan = ShardingPlan.from_dict({"parameter": {r"head\.weight": ["R", "R", "S(0)"]}})
    with pytest.raises(ShardingPlanError, match=r"3 placements for a 2-dim mesh of shape \(2, 2\)"):
        plan.resolve(TinyNet(), mesh_shape=(2, 2), mesh_dim=1)


def test_mesh_dim_out_of_range_is_refused():
    with pytest.raises(ShardingPlanError, match=r"mesh dim 2 does not exist in a mesh of shape \(2, 2\)"):
        ShardingPlan().resolve(TinyNet(), mesh_shape=(2, 2), mesh_dim=2)


def test_tied_parameters_must_get_the_same_placements():
    plan = ShardingPlan.from_dict({"parameter": {r"embed\.weight": "S(0)"}})
    with pytest.raises(ShardingPlanError, match=r"'embed\.weight' and 'head\.weight' are one tied tensor"):
        plan.resolve(TinyNet(tied=True), mesh_shape=(2,), mesh_dim=0)
    both = ShardingPlan.from_dict({"parameter": {r"(embed|head)\.weight": "S(0)"}})
    resolved = both.resolve(TinyNet(tied=True), mesh_shape=(2,), mesh_dim=0)
    assert resolved.parameters["head.weight"].placements == (Shard(0),)


def test_resolution_works_on_meta_modules_and_prints_a_table():
    with torch.device("meta"):
        model = TinyNet()
    resolved = ShardingPlan.from_dict(MEGATRON_PLAN).resolve(model, mesh_shape=(1, 2), mesh_dim=1)
    table = resolved.format_table()
    assert table.splitlines()[0].split() == ["kind", "fqn", "placements", "from", "pattern"]
    assert "parameter  blocks.0.qkv.weight  [R, IS(0,3)]" in table


def test_plan_error_is_a_dmodule_error_and_a_value_error():
    assert issubclass(ShardingPlanError, DModuleError)
    assert issubclass(ShardingPlanError, ValueError)


def test_gpt2_pattern_without_its_prefix_points_at_the_real_fqn():
    from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config

    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(tiny_hf_config("gpt2"))
    plan = ShardingPlan.from_dict({"forward": {r"h\.\d+\.mlp.input": ["R"]}})
    with pytest.raises(ShardingPlanError, match=r"matched no module; closest: 'transformer\.h\.0\.mlp'"):
        plan.resolve(model, mesh_shape=(2,), mesh_dim=0)
