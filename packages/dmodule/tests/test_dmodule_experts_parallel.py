"""Expert parallelism of untouched transformers MoE models against single-device training.

Mixtral, Qwen3-MoE and DeepSeek-V3, tiny (``vescale.dmodule.testing.moe_models``: 8 experts,
top-2, output_router_logits=True, other fields at their defaults), on 4 gloo ranks as
ep4 and dp2 x ep2. The global batch (8 sequences) is split over the 4 batch ranks; the
reference is one process training the whole global batch.

Compared: the global loss (mean of the ranks' losses; every rank has the same number of
label tokens), every parameter's gradient after step 1 (averaged with
``average_gradients``: experts over dp, the rest over dp x ep), the parameters after one
SGD step and the loss of step 2. Tolerance 1e-5 relative (the kit's ``EXPERT_PARALLEL_RTOL``):
float32 sums in another order (the grouped GEMM's rows and the gradient all-reduce); measured
noise ~1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vescale.dmodule.testing.moe_models import (
    EXPERT_PARALLEL_RTOL,
    assert_ranks_within,
    batch_shard,
    global_batch,
    global_mean,
    step_beside_reference,
    tiny_moe,
    worst_over_ranks,
)
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import gradient_errors, relative_error


def _parallel_step_matches_single_device(name: str, mesh_dims: dict[str, int]) -> dict[str, float]:
    from vescale.dmodule import parallelize_experts
    from vescale.dmodule.experts import is_expert_parameter

    reference = tiny_moe(name)
    model = copy.deepcopy(reference)
    mesh = init_mesh(**mesh_dims)
    parallelize_experts(model, mesh)
    ep = mesh_dims["ep"]

    expert_params = [p for p in model.parameters() if is_expert_parameter(p)]
    assert expert_params, "no expert parameter was sharded"
    assert sum(p.to_local().numel() for p in expert_params) * ep == sum(p.numel() for p in expert_params)
    reference_experts = [p for n, p in reference.named_parameters() if ".experts." in n]
    assert sum(p.numel() for p in expert_params) == sum(p.numel() for p in reference_experts)

    reference_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    errors = {}
    for step in range(2):
        output, reference_output = step_beside_reference(model, reference, mesh)
        errors[f"loss{step}"] = relative_error(global_mean(output.loss), reference_output.loss)
        if output.get("aux_loss") is not None:
            errors[f"aux_loss{step}"] = relative_error(output.aux_loss, reference_output.aux_loss)
        if step == 0:
            errors["grad"] = max(gradient_errors(model, reference).values())
        sgd.step()
        reference_sgd.step()
        sgd.zero_grad()
        reference_sgd.zero_grad()
    reference_params = dict(reference.named_parameters())
    errors["param_after_sgd"] = max(
        relative_error(p, reference_params[fqn]) for fqn, p in model.named_parameters()
    )
    return errors


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mesh_dims", [{"ep": 4}, {"dp": 2, "ep": 2}], ids=["ep4", "dp2xep2"])
def test_expert_parallel_step_matches_single_device(name, mesh_dims):
    results = run_on_ranks(_parallel_step_matches_single_device, 4, (name, mesh_dims))
    assert_ranks_within(results, f"{name} {mesh_dims}")


def _dmodule_outside_experts(name: str, mesh_dims: dict[str, int]) -> dict[str, float]:
    from vescale.dmodule import auto_sharding_plan, parallelize_experts, parallelize_module

    reference = tiny_moe(name)
    model = copy.deepcopy(reference)
    mesh = init_mesh(**mesh_dims)
    if "tp" in mesh_dims:
        plan = auto_sharding_plan(model).to_dict()
        plan["parameter"] = {fqn: p for fqn, p in plan["parameter"].items() if "experts" not in fqn}
        parallelize_module(model, mesh, plan, mesh_dim="tp")
    else:
        # No tensor parallelism: an empty plan makes every parameter a Replicate DTensor on the mesh.
        parallelize_module(model, mesh, {"parameter": {}}, mesh_dim="ep")
    parallelize_experts(model, mesh)
    output, reference_output = step_beside_reference(model, reference, mesh)
    # The tp ranks of one ep rank hold the same loss; the global loss is the ep ranks' mean.
    loss = output.loss.full_tensor().detach().clone()
    torch.distributed.all_reduce(loss, group=mesh.get_group("ep"))
    return {
        "loss": relative_error(loss / mesh_dims["ep"], reference_output.loss),
        "grad": max(gradient_errors(model, reference).values()),
    }


@pytest.mark.parametrize(
    ("name", "mesh_dims"),
    [
        ("mixtral", {"ep": 2, "tp": 2}),
        ("qwen3_moe", {"ep": 2, "tp": 2}),
        ("deepseek_v3", {"ep": 2, "tp": 2}),
        ("mixtral", {"ep": 4}),
    ],
)
def test_experts_over_ep_inside_a_dmodule(name, mesh_dims):
    """ep2 x tp2: dmodule's automatic plan on everything but the experts, experts over ep; ep4: every
    non-expert parameter a Replicate DTensor (parallelize_module's empty plan), experts over ep."""
    results = run_on_ranks(_dmodule_outside_experts, 4, (name, mesh_dims))
    assert_ranks_within(results, f"{name} {mesh_dims}")


def _data_parallel_global_aux_loss(name: str) -> dict[str, float]:
    from vescale.dmodule.experts import attach_global_aux_loss, average_gradients

    reference = tiny_moe(name)
    per_rank, global_statistic = copy.deepcopy(reference), copy.deepcopy(reference)
    mesh = init_mesh(dp=4)
    attach_global_aux_loss(global_statistic, mesh, batch_dims=("dp",))
    ids = global_batch()
    local_ids = batch_shard(ids, mesh)
    reference_output = reference(input_ids=ids, labels=ids)
    reference_output.loss.backward()
    errors = {}
    for label, model in (("per_rank", per_rank), ("global", global_statistic)):
        output = model(input_ids=local_ids, labels=local_ids)
        output.loss.backward()
        average_gradients(model, mesh, batch_dims=("dp",))
        errors[f"{label}_loss"] = relative_error(global_mean(output.loss), reference_output.loss)
        errors[f"{label}_grad"] = max(gradient_errors(model, reference).values())
    return errors


@pytest.mark.parametrize("name", ["olmoe"])
def test_data_parallel_load_balancing_loss_is_the_global_batch_one(name):
    """dp4, experts replicated: with attach_global_aux_loss the loss and every gradient equal single
    device; with transformers' per-rank statistic they do not (the test would see the difference)."""
    results = run_on_ranks(_data_parallel_global_aux_loss, 4, (name,))
    print(f"{name} dp4: worst over ranks", worst_over_ranks(results))
    for rank, errors in enumerate(results):
        assert max(errors["global_loss"], errors["global_grad"]) <= EXPERT_PARALLEL_RTOL, (rank, errors)
        assert errors["per_rank_grad"] > 100 * EXPERT_PARALLEL_RTOL, (rank, errors)


def _refused_expert_dim_split() -> str:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from vescale.dmodule import parallelize_experts
    from vescale.dmodule.experts import ExpertParallelError

    mesh = init_mesh(ep=2, tp=2)
    model = tiny_moe("mixtral")
    experts = model.model.layers[0].mlp.experts
    # The expert dim split over tp: each rank would hold other experts than ep gives it.
    whole = experts.gate_up_proj.detach()
    experts.gate_up_proj = torch.nn.Parameter(distribute_tensor(whole, mesh, [Replicate(), Shard(0)]))
    try:
        parallelize_experts(model, mesh)
    except ExpertParallelError as error:
        return str(error)
    return "accepted"


def test_experts_split_over_their_expert_dim_by_tp_are_refused():
    """Expert tensor parallelism keeps splits inside each expert (dims 1, 2); a tensor-parallel split of
    the expert dim is a typed error naming the parameter and the fix."""
    message = run_on_ranks(_refused_expert_dim_split, 4)[0]
    assert "gate_up_proj is S(0) on mesh dim 'tp'" in message, message
    assert "leave the experts Replicate in the tensor-parallel plan" in message, message
