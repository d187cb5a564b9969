"""Expert parallelism of untouched transformers MoE models against single-device training.

Mixtral, Qwen3-MoE and DeepSeek-V3, tiny (8 experts, top-2, output_router_logits=True,
every other config field at the architecture's default except sizes), on 4 gloo ranks as
ep4 and dp2 x ep2. The global batch (8 sequences) is split over the 4 batch ranks; the
reference is one process training the whole global batch.

Compared: the global loss (mean of the ranks' losses; every rank has the same number of
label tokens), every parameter's gradient after step 1 (averaged with
``average_gradients``: experts over dp, the rest over dp x ep), the parameters after one
SGD step and the loss of step 2. Tolerance 1e-5 relative: float32 sums in another order
(the grouped GEMM's rows and the gradient all-reduce); measured noise ~1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import gradient_errors, relative_error

TOLERANCE = 1e-5
GLOBAL_BATCH = 8
SEQ_LEN = 8
VOCAB = 64


def tiny_moe(name: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny MoE causal LM: 8 experts, top-2, router logits (and aux loss where the model has one) on."""
    import transformers

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    if name == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=8, intermediate_size=32, **sizes)
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_experts=8, moe_intermediate_size=16, intermediate_size=32, head_dim=8, **sizes
        )
    elif name == "deepseek_v3":
        # One dense layer first, then MoE; 4 groups of 2 experts, the best 2 groups eligible.
        config = transformers.DeepseekV3Config(
            n_routed_experts=8,
            moe_intermediate_size=16,
            intermediate_size=32,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            head_dim=4,
            **sizes,
        )
    else:
        raise ValueError(name)
    for field_name, value in overrides.items():
        setattr(config, field_name, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def global_batch(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator)


def batch_rank(mesh) -> tuple[int, int]:
    """(this rank's index among the batch ranks, their number): dp outer, ep inner."""
    names = mesh.mesh_dim_names
    dims = [dim for dim in ("dp", "ep") if dim in names]
    index, count = 0, 1
    for dim in dims:
        size = mesh.size(names.index(dim))
        index, count = index * size + mesh.get_local_rank(dim), count * size
    return index, count


def shard_of(ids: torch.Tensor, mesh) -> torch.Tensor:
    index, count = batch_rank(mesh)
    per_rank = ids.shape[0] // count
    return ids[index * per_rank : (index + 1) * per_rank]


def global_loss(loss: torch.Tensor) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _parallel_step_matches_single_device(name: str, mesh_dims: dict[str, int]) -> dict[str, float]:
    from vescale.dmodule import parallelize_experts
    from vescale.dmodule.experts import average_gradients, is_expert_parameter

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

    ids = global_batch()
    reference_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    errors = {}
    for step in range(2):
        local_ids = shard_of(ids, mesh)
        output = model(input_ids=local_ids, labels=local_ids)
        output.loss.backward()
        average_gradients(model, mesh)
        reference_output = reference(input_ids=ids, labels=ids)
        reference_output.loss.backward()
        errors[f"loss{step}"] = relative_error(global_loss(output.loss), reference_output.loss)
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
    for rank, errors in enumerate(results):
        assert max(errors.values()) <= TOLERANCE, (rank, errors)
