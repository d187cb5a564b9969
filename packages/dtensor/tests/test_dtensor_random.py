"""Random ops on DTensors against the same calls on full tensors in one process.

Every comparison is bitwise (``torch.equal``): random values are drawn, not computed by
reductions, so the sharded run must reproduce the single-process values exactly. Each
sequence also ends with a plain ``torch.rand`` on every rank, which matches only if every
rank's generator ended each DTensor op in the single process's state.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor as dtensor_factories
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.dtensor._random_strategy import RandomCall, slice_model
from vescale.dtensor.mesh import device_type_for_backend
from vescale.dtensor.placements import distribute_tensor, placement_from_string, to_torch_placements
from vescale.dtensor.random import RandomOpError, manual_seed
from vescale.dtensor.testing import run_on_ranks

SEED = 1234
aten = torch.ops.aten


def random_sequence(make, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The calls under test, on tensors built by ``make(full_tensor)`` (plain or distributed)."""
    values = []
    torch.nn.init.normal_(weight := make(torch.empty(shape)), mean=0.5, std=2.0)
    values.append(weight)
    values.append(F.dropout(make(torch.ones(shape)), p=0.3))
    values.append(torch.nn.init.uniform_(make(torch.empty(shape)), -0.1, 0.1))
    values.append(torch.rand_like(weight))
    values.append(torch.randn_like(weight))
    values.append(make(torch.empty(shape)).exponential_())
    values.append(torch.nn.init.xavier_normal_(make(torch.empty(shape))))
    return values


def single_process_values(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    values = random_sequence(lambda full: full, shape)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False, device="meta").to_empty(device="cpu")
    linear.reset_parameters()  # kaiming_uniform_(a=sqrt(5)) on the (out, in) weight
    values += [linear.weight.detach(), torch.randn(shape), torch.rand(shape), torch.rand(5)]
    return values


# --- functions that run on the ranks (module level: ranks look them up by name) ---


def _mesh(mesh_shape: tuple[int, ...]):
    return init_device_mesh(device_type_for_backend(dist.get_backend()), mesh_shape)


def sharded_values_on_ranks(mesh_shape, shape, placement_texts, seed):
    mesh = _mesh(mesh_shape)
    placements = [placement_from_string(text) for text in placement_texts]
    manual_seed(seed)
    values = random_sequence(lambda full: distribute_tensor(full, mesh, placements), shape)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(distribute_tensor(torch.empty(shape), mesh, placements))
    linear.reset_parameters()
    values.append(linear.weight.detach())
    torch_placements = to_torch_placements(placements)
    values.append(dtensor_factories.randn(*shape, device_mesh=mesh, placements=torch_placements))
    values.append(dtensor_factories.rand(*shape, device_mesh=mesh, placements=torch_placements))
    layouts = [[str(p) for p in value.placements] for value in values]
    return [value.full_tensor() for value in values] + [torch.rand(5)], layouts


def partial_inputs_on_ranks(seed):
    mesh = _mesh((dist.get_world_size(),))
    manual_seed(seed)
    base = torch.arange(24.0).reshape(4, 6) / 24
    partial = DTensor.from_local(base / dist.get_world_size(), mesh, [Partial()], run_check=False)
    like = torch.rand_like(partial)
    output, mask = aten.native_dropout.default(partial, 0.4, True)
    filled = DTensor.from_local(torch.zeros(4, 6), mesh, [Partial()], run_check=False).normal_()
    return [
        str(like.placements),
        like.full_tensor(),
        output.full_tensor(),
        mask.full_tensor(),
        filled.full_tensor(),
    ]


def native_dropout_on_ranks(placement_texts, seed):
    mesh = _mesh((dist.get_world_size(),))
    manual_seed(seed)
    activation = distribute_tensor(torch.linspace(-1, 1, 6 * 40).reshape(6, 40), mesh, placement_texts)
    output, mask = aten.native_dropout.default(activation, 0.25, True)
    # gloo cannot all-gather bool tensors: the mask travels as uint8.
    return [output.full_tensor(), mask.to(torch.uint8).full_tensor().bool(), torch.rand(3)]


def unsupported_random_op_on_ranks(case):
    mesh = _mesh((dist.get_world_size(),))
    manual_seed(0)
    if case == "bernoulli_tensor":
        probabilities = distribute_tensor(torch.full((4, 4), 0.5), mesh, [Shard(0)])
        torch.empty_like(probabilities).bernoulli_(probabilities)
    elif case == "partial_max_fill":
        DTensor.from_local(torch.zeros(4), mesh, [Partial("max")], run_check=False).uniform_()
    elif case == "bad_seed":
        manual_seed(1.5)


def replicated_bernoulli_tensor_on_ranks(seed):
    mesh = _mesh((dist.get_world_size(),))
    manual_seed(seed)
    probabilities = distribute_tensor(torch.linspace(0, 1, 12), mesh, [Replicate()])
    return torch.bernoulli(probabilities).full_tensor()


# --- tests ---

CASES = [
    # (mesh shape, global shape, placements): even, uneven, 2-D and fused layouts
    ((2,), (8, 48), ["S(0)"]),
    ((2,), (8, 48), ["S(1)"]),
    ((4,), (10, 33), ["S(0)"]),
    ((4,), (7, 33), ["S(1)"]),
    ((2, 2), (9, 32), ["S(0)", "S(1)"]),
    ((2, 2), (8, 32), ["S(0)", "S(0)"]),
    ((2, 2), (6, 32), ["R", "IS(0,3)"]),
]


@pytest.mark.parametrize(("mesh_shape", "shape", "placements"), CASES, ids=lambda case: str(case))
def test_random_ops_on_dtensors_equal_single_process_values(mesh_shape, shape, placements):
    reference = single_process_values(shape, SEED)
    world_size = math.prod(mesh_shape)
    results = run_on_ranks(sharded_values_on_ranks, world_size, args=(mesh_shape, shape, placements, SEED))
    for rank, (values, layouts) in enumerate(results):
        assert all(len(layout) == len(mesh_shape) for layout in layouts)
        for index, (value, expected) in enumerate(zip(values, reference, strict=True)):
            assert torch.equal(value, expected), f"rank {rank}, value {index} of the sequence differs"


def test_partial_inputs_reduce_or_replicate_exactly():
    torch.manual_seed(SEED)
    base = torch.arange(24.0).reshape(4, 6) / 24
    like = torch.rand_like(base)
    output, mask = aten.native_dropout.default(base, 0.4, True)
    filled = torch.zeros(4, 6).normal_()
    for result in run_on_ranks(partial_inputs_on_ranks, 2, args=(SEED,)):
        assert result[0] == "(Replicate(),)"
        # The Partial input sums two halves of base exactly (powers of two), so the reduced
        # input equals base bitwise and the dropout output must too.
        for value, expected in zip(result[1:], [like, output, mask, filled], strict=True):
            assert torch.equal(value, expected)


@pytest.mark.parametrize("placement", ["S(0)", "S(1)"])
def test_native_dropout_equals_single_process(placement):
    torch.manual_seed(SEED)
    output, mask = aten.native_dropout.default(torch.linspace(-1, 1, 6 * 40).reshape(6, 40), 0.25, True)
    expected = [output, mask, torch.rand(3)]
    for result in run_on_ranks(native_dropout_on_ranks, 4, args=([placement], SEED)):
        for value, reference in zip(result, expected, strict=True):
            assert torch.equal(value, reference)


def test_replicated_random_op_outside_the_exact_families_runs_locally():
    torch.manual_seed(SEED)
    expected = torch.bernoulli(torch.linspace(0, 1, 12))
    for value in run_on_ranks(replicated_bernoulli_tensor_on_ranks, 2, args=(SEED,)):
        assert torch.equal(value, expected)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bernoulli_tensor", r"aten\.bernoulli_\.Tensor on a DTensor with placements \[S\(0\)\]"),
        ("partial_max_fill", r"\[P\(max\)\]: P\(max\) on mesh dim 0 cannot hold random values"),
        ("bad_seed", r"manual_seed takes an int seed.*1\.5"),
    ],
)
def test_inexact_cases_raise_a_typed_error_naming_op_and_placement(case, message):
    with pytest.raises(RandomOpError, match=message):
        run_on_ranks(unsupported_random_op_on_ranks, 2, args=(case,))


def test_slice_models_measured_on_this_build_match_the_mt19937_facts():
    # uniform_ draws one 32-bit word per float32 element; normal_ works in 16-element blocks.
    assert slice_model(RandomCall(aten.uniform_.default, "fill", (0.0, 1.0), {}, None), torch.float32) == (
        1,
        1,
    )
    assert slice_model(RandomCall(aten.normal_.default, "fill", (0.0, 1.0), {}, None), torch.float32) == (
        1,
        16,
    )


def test_slice_model_first_measured_inside_a_fake_pass_is_the_real_one(monkeypatch):
    # dpipe's split runs a tensor-parallel model's dropout under FakeTensorMode, and that
    # may be the process's first draw of the op: the measurement must still run for real.
    from vescale.dtensor import _compat, _random_strategy

    monkeypatch.setattr(_random_strategy, "_slice_models", {})
    call = RandomCall(aten.bernoulli_.float, "fill", (0.5,), {}, None)
    with _compat.fake_tensor_mode_class()():
        inside = slice_model(call, torch.float32)
    monkeypatch.setattr(_random_strategy, "_slice_models", {})
    assert inside == slice_model(call, torch.float32) is not None
