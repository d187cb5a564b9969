"""The planner's default sequence length respects what a model's forward accepts (issue #18).

Reformer's axial position embeddings train only on sequences of exactly the product of
``axial_pos_shape``; ProphetNet's relative-position buckets cover two positions fewer than its
``max_position_embeddings``. A profile at the length the config names failed for both; the
planner now takes the exact length where the config fixes one, else halves the length (with a
warning) until the forward runs. A length the user sets is never changed.
"""

from __future__ import annotations

import logging

import pytest

from vescale.dmodule import deferred_init
from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm
from vescale.planner import PlanError, generate_plan
from vescale.planner.profile import profile_model

_CONSTRAINTS = {"tensor_parallel.size": 1, "global_batch_size": 4, "memory_per_device_gb": 1.0}


def test_reformer_is_profiled_at_the_product_of_its_axial_position_shape():
    model = deferred_init(build_tiny_causal_lm, "reformer", None)
    assert tuple(model.config.axial_pos_shape) == (2, 4) and model.config.max_position_embeddings == 64
    plan = generate_plan(model, _CONSTRAINTS, world_size=1)
    assert plan.sequence_length == 8
    assert "axial_pos_shape (2 x 4 = 8 positions)" in plan.to_dict()["reasons"]["sequence_length"]


def test_prophetnet_is_profiled_at_the_longest_half_of_its_positions_that_runs(caplog):
    model = deferred_init(build_tiny_causal_lm, "prophetnet", None)
    assert model.config.max_position_embeddings == 64
    with pytest.raises(PlanError, match="of 64 tokens"):
        profile_model(model, 64)
    with caplog.at_level(logging.WARNING, logger="vescale.planner"):
        plan = generate_plan(model, _CONSTRAINTS, world_size=1)
    assert plan.sequence_length == 32
    assert "profiled at 32 tokens instead" in caplog.text
    assert "fails" in plan.to_dict()["reasons"]["sequence_length"]


def test_a_sequence_length_the_user_sets_is_never_shortened():
    model = deferred_init(build_tiny_causal_lm, "prophetnet", None)
    with pytest.raises(PlanError, match="of 64 tokens"):
        generate_plan(model, {**_CONSTRAINTS, "sequence_length": 64}, world_size=1)
