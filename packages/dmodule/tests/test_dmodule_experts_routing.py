"""Expert-parallel routing edge cases, communication bytes and the global load-balancing loss.

* A router forced to send every token to the same experts (DeepSeek-V3: a score-correction
  bias; Mixtral: a zero router, whose ties every token breaks alike): no hang, the other
  experts' gradients are exactly zero, loss and gradients equal single device.
* The dispatch and combine all-to-alls move exactly the bytes of the pairs that change rank,
  forward and backward; with balanced routing that is tokens x top-k x hidden x 4 x (ep-1)/ep
  per direction.
* ``capacity_factor`` drops the pairs past each expert's capacity in token order, and the
  output equals the experts' with those pairs' router weights set to zero; the per-expert
  loop equals the grouped GEMM.
* ``global_load_balancing_loss`` on one process equals transformers' own function.
"""

from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch
import torch.distributed as dist

from vescale.dmodule.testing.moe_models import (
    EXPERT_PARALLEL_RTOL,
    assert_ranks_within,
    batch_shard,
    global_batch,
    global_mean,
    step_beside_reference,
    tiny_moe,
)
from vescale.dtensor import init_mesh
from vescale.dtensor.comm import FORWARD, CommCounter
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import full_value, gradient_errors, relative_error


def _force_routing(model: torch.nn.Module, name: str) -> None:
    with torch.no_grad():
        for fqn, module in model.named_modules():
            if fqn.endswith("mlp.gate") and name == "deepseek_v3":
                module.e_score_correction_bias[:2] = 10.0  # experts 0 and 1 win every token
            elif fqn.endswith("mlp.gate"):
                module.weight.zero_()  # every score ties: every token picks the same two


def _routing_of(model: torch.nn.Module) -> list:
    """Registers hooks that collect each router's top-k indices; returns the list they fill."""
    seen = []
    for fqn, module in model.named_modules():
        if fqn.endswith("mlp.gate"):
            module.register_forward_hook(lambda _module, _args, output: seen.append(output[2].detach()))
    return seen


def _forced_router(name: str) -> dict:
    from vescale.dmodule import parallelize_experts

    reference = tiny_moe(name)
    _force_routing(reference, name)
    model = copy.deepcopy(reference)
    mesh = init_mesh(ep=4)
    parallelize_experts(model, mesh)
    routing = _routing_of(model)
    output, reference_output = step_beside_reference(model, reference, mesh)
    chosen = torch.unique(torch.cat([indices.reshape(-1) for indices in routing])).tolist()
    assert len(chosen) == 2, f"the forced router chose experts {chosen}"
    for fqn, param in model.named_parameters():
        if ".experts." in fqn:
            grad = full_value(param.grad)
            others = [e for e in range(grad.shape[0]) if e not in chosen]
            assert torch.count_nonzero(grad[others]) == 0, fqn
            assert torch.count_nonzero(grad[chosen]) > 0, fqn
    return {
        "loss": relative_error(global_mean(output.loss), reference_output.loss),
        "grad": max(gradient_errors(model, reference).values()),
    }


@pytest.mark.parametrize("name", ["deepseek_v3", "mixtral"])
def test_forced_router_sends_every_token_to_the_same_experts(name):
    assert_ranks_within(run_on_ranks(_forced_router, 4, (name,)), f"forced router {name} ep4")


def _dispatch_bytes_match_routing() -> None:
    from vescale.dmodule import parallelize_experts
    from vescale.dmodule.experts import ExpertParallelError

    model = tiny_moe("mixtral")
    mesh = init_mesh(ep=4)
    parallelize_experts(model, mesh)
    routing = _routing_of(model)
    hidden, element_size, ep, rank = model.config.hidden_size, 4, 4, dist.get_rank()
    local_ids = batch_shard(global_batch(), mesh)
    with CommCounter(mesh) as counter:
        model(input_ids=local_ids, labels=local_ids).loss.backward()
    for layer, indices in enumerate(routing):
        gathered = [torch.empty_like(indices) for _ in range(ep)]
        dist.all_gather(gathered, indices)
        owners = [source.reshape(-1) // (8 // ep) for source in gathered]
        sent = int((owners[rank] != rank).sum())
        received = sum(int((owners[source] == rank).sum()) for source in range(ep) if source != rank)
        scope = f"model.layers.{layer}.mlp.experts"
        for direction, out_pairs, in_pairs in (("dispatch", sent, received), ("combine", received, sent)):
            calls = [c for c in counter.calls if c.scope == f"{scope}/{direction}"]
            forward = [c for c in calls if c.phase == FORWARD]
            backward = [c for c in calls if c.phase != FORWARD]
            assert len(forward) == len(backward) == 1, (scope, direction, calls)
            assert forward[0].bytes_sent == out_pairs * hidden * element_size
            assert forward[0].bytes_received == in_pairs * hidden * element_size
            # The backward sends the gradients of what the forward received, back to where it came from.
            assert backward[0].bytes_sent == in_pairs * hidden * element_size
            assert backward[0].bytes_received == out_pairs * hidden * element_size
        assert counter.count("all_to_all", "ep", scope=scope) == 5  # counts, then dispatch and combine x 2

    # Typed errors that name the module and the mesh.
    with pytest.raises(ExpertParallelError, match=r"model\.layers\.0\.mlp\.experts: 6 experts"):
        parallelize_experts(tiny_moe("mixtral", num_local_experts=6), mesh)
    with pytest.raises(ExpertParallelError, match="has no 'ep' dim"):
        parallelize_experts(tiny_moe("mixtral"), init_mesh(dp=4))


def _balanced_dispatch_and_capacity() -> None:
    from vescale.dmodule import parallelize_experts
    from vescale.dmodule.experts import dropped_pairs, expert_parallel_state

    ep, tokens, top_k, num_experts = 4, 16, 2, 8
    reference = tiny_moe("mixtral").model.layers[0].mlp.experts
    hidden = reference.hidden_dim
    mesh = init_mesh(ep=ep)
    model = tiny_moe("mixtral")
    parallelize_experts(model, mesh)
    experts = model.model.layers[0].mlp.experts
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    states = torch.randn(tokens, hidden, generator=generator, requires_grad=True)
    weights = torch.rand(tokens, top_k, generator=generator, requires_grad=True)

    # Balanced: token t of rank r goes to experts (t + r) % E and (t + r + 1) % E.
    first = (torch.arange(tokens) + rank) % num_experts
    balanced = torch.stack([first, (first + 1) % num_experts], dim=1)
    with CommCounter(mesh) as counter:
        experts(states, balanced, weights).square().sum().backward()
    analytic = tokens * top_k * hidden * 4 * (ep - 1) / ep
    for direction in ("dispatch", "combine"):
        for call in [c for c in counter.calls if c.scope == f"model.layers.0.mlp.experts/{direction}"]:
            assert call.bytes_sent == call.bytes_received == analytic, (direction, call)

    # Skewed routing with a capacity: every token's first choice is expert 0, second expert 5.
    skewed = torch.stack([torch.zeros(tokens, dtype=torch.long), torch.full((tokens,), 5)], dim=1)
    expert_parallel_state(experts).capacity_factor = 1.0
    capacity = math.ceil(1.0 * tokens * top_k / num_experts)
    out = experts(states, skewed, weights)
    assert dropped_pairs(model)["model.layers.0.mlp.experts"] == 2 * (tokens - capacity)
    kept_weights = weights.detach().clone()
    kept_weights[capacity:] = 0.0  # the pairs past the capacity, in token order
    expected = reference(states.detach(), skewed, kept_weights)
    assert relative_error(out, expected) <= EXPERT_PARALLEL_RTOL
    assert torch.count_nonzero(out[capacity:]) == 0

    # The per-expert loop and the grouped GEMM give the same outputs and gradients.
    expert_parallel_state(experts).capacity_factor = None
    results = []
    for use_grouped_mm in (True, False):
        expert_parallel_state(experts).local_experts.use_grouped_mm = use_grouped_mm
        experts.zero_grad()
        out = experts(states, balanced, weights)
        out.square().sum().backward()
        results.append((out.detach(), experts.gate_up_proj.grad.to_local().clone()))
    assert relative_error(results[1][0], results[0][0]) <= EXPERT_PARALLEL_RTOL
    assert relative_error(results[1][1], results[0][1]) <= EXPERT_PARALLEL_RTOL


def test_dispatch_bytes_and_errors():
    run_on_ranks(_dispatch_bytes_match_routing, 4)


def test_balanced_dispatch_bytes_capacity_and_loop():
    run_on_ranks(_balanced_dispatch_and_capacity, 4)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("masked", [False, True])
def test_global_aux_loss_equals_transformers_on_one_process(name, masked):
    from vescale.dmodule.experts import global_load_balancing_loss

    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    hf_function = modeling.load_balancing_loss_func
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, 8, generator=generator) for _ in range(3))
    mask = (torch.rand(3, 4, generator=generator) > 0.3).long() if masked else None
    ours = global_load_balancing_loss(logits, 8, 2, mask)
    assert relative_error(ours, hf_function(logits, 8, 2, mask)) <= 1e-6


def test_float32_router_in_a_bfloat16_model():
    """route_in_float32: float32 logits and top-k, hooks run once, gradients reach the bf16 weight."""
    from vescale.dmodule.experts import route_in_float32

    model = tiny_moe("mixtral").to(torch.bfloat16)
    router = model.model.layers[0].mlp.gate
    route_in_float32(router)
    calls = []
    router.register_forward_hook(lambda *_: calls.append(1))
    output = model(input_ids=global_batch()[:2], labels=global_batch()[:2])
    output.loss.backward()
    assert len(calls) == 1 and output.router_logits[0].dtype == torch.float32
    assert router.weight.dtype == router.weight.grad.dtype == torch.bfloat16
    hidden = torch.randn(5, 32, dtype=torch.bfloat16)
    logits, _, _ = router(hidden)
    assert torch.equal(logits, torch.nn.functional.linear(hidden.float(), router.weight.float()))
