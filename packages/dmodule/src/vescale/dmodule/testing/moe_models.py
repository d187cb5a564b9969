"""Tiny MoE models and batches shared by the expert-parallel tests and measurements.

Mixtral, Qwen3-MoE, DeepSeek-V3 and OLMoE at tiny sizes: 8 experts, top-2, router logits
(and the load-balancing loss where the model has one) on, every other config field at the
architecture's default (tied embeddings, norms, biases, GQA ratio). DeepSeek-V3 keeps one
dense layer first, routes within the best 2 of 4 groups of 2 experts and has as many key/value
heads as query heads (its default). The global batch
is split over the batch ranks (dp outer, ep inner), each taking an equal share of rows.

``transformers`` is a test dependency: it is imported only when a model is built.

Example::

    model = tiny_moe("qwen3_moe")
    ids = global_batch()
    local_ids = batch_shard(ids, mesh)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "EXPERT_PARALLEL_RTOL",
    "GLOBAL_BATCH",
    "MOE_MODELS",
    "SEQ_LEN",
    "VOCAB",
    "assert_ranks_within",
    "batch_shard",
    "global_batch",
    "global_mean",
    "step_beside_reference",
    "tiny_moe",
    "worst_over_ranks",
]

MOE_MODELS = ("mixtral", "qwen3_moe", "deepseek_v3", "olmoe")
GLOBAL_BATCH = 8
SEQ_LEN = 8
VOCAB = 64
# Relative error of these models under expert parallelism against one process (losses, gradients,
# outputs): float32 sums in another order (the grouped GEMM's rows, the gradient all-reduce),
# measured ~1e-6 (tests/test_dmodule_experts_parallel.py and _routing.py print it).
EXPERT_PARALLEL_RTOL = 1e-5


def _config(name: str) -> Any:
    import transformers

    sizes: dict[str, Any] = dict(
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
        return transformers.MixtralConfig(num_local_experts=8, intermediate_size=32, **sizes)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            num_experts=8,
            moe_intermediate_size=16,
            intermediate_size=32,
            # Taken by PretrainedConfig's keyword arguments, which the config's annotations omit.
            head_dim=8,  # type: ignore[call-arg]
            **sizes,
        )
    if name == "olmoe":
        return transformers.OlmoeConfig(num_experts=8, intermediate_size=32, **sizes)
    if name == "deepseek_v3":
        return transformers.DeepseekV3Config(
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
            head_dim=4,  # type: ignore[call-arg]  # as above
            # DeepSeek-V3's default: as many key/value heads as query heads (multi-head latent
            # attention). With fewer, transformers repeats its keys into too many heads whenever
            # SDPA gets a mask (padding, or a pass on fake tensors such as dpipe's trace) and fails.
            **{**sizes, "num_key_value_heads": sizes["num_attention_heads"]},
        )
    raise ValueError(f"unknown tiny MoE model {name!r}; choose one of {MOE_MODELS}")


def tiny_moe(name: str, seed: int = 0, **overrides: object) -> nn.Module:
    """The tiny causal LM ``name`` (in :data:`MOE_MODELS`), weights drawn from ``seed``, in train mode.

    Example::

        model = tiny_moe("mixtral", num_local_experts=6)   # overrides replace config fields
    """
    import transformers

    config = _config(name)
    for field_name, value in overrides.items():
        setattr(config, field_name, value)
    torch.manual_seed(seed)
    # transformers leaves from_config unannotated.
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.train()
    return model


def global_batch(seed: int = 1, batch_size: int = GLOBAL_BATCH) -> torch.Tensor:
    """The (batch_size, :data:`SEQ_LEN`) token ids of one global batch drawn from ``seed``.

    Example::

        ids = global_batch(seed=step + 1)
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, SEQ_LEN), generator=generator)


def batch_shard(
    ids: torch.Tensor, mesh: DeviceMesh, batch_dims: tuple[str, ...] = ("dp", "ep")
) -> torch.Tensor:
    """This rank's rows of ``ids``: the batch split over ``batch_dims`` (outer first) of ``mesh``.

    Example::

        local_ids = batch_shard(global_batch(), init_mesh(dp=2, ep=2))   # 2 of the 8 rows
    """
    names = mesh.mesh_dim_names or ()
    index, count = 0, 1
    for dim in (dim for dim in batch_dims if dim in names):
        size = mesh.size(names.index(dim))
        index, count = index * size + mesh.get_local_rank(dim), count * size
    per_rank = ids.shape[0] // count
    return ids[index * per_rank : (index + 1) * per_rank]


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over every rank (detached): the global loss from the ranks' losses.

    Example::

        loss = global_mean(output.loss)   # equal row counts: the global batch's mean loss
    """
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def step_beside_reference(
    model: nn.Module,
    reference: nn.Module,
    mesh: DeviceMesh,
    ids: torch.Tensor | None = None,
    *,
    batch_dims: tuple[str, ...] | None = None,
) -> tuple[Any, Any]:
    """One training step's forward and backward of the parallel ``model`` on this rank's share of
    ``ids`` (gradients averaged with ``average_gradients``) and of ``reference`` on all of ``ids``
    (default :func:`global_batch`); returns both outputs.

    Example::

        output, reference_output = step_beside_reference(model, reference, mesh)
        relative_error(global_mean(output.loss), reference_output.loss)
    """
    from vescale.dmodule.experts import average_gradients

    ids = global_batch() if ids is None else ids
    local_ids = batch_shard(ids, mesh) if batch_dims is None else batch_shard(ids, mesh, batch_dims)
    output = model(input_ids=local_ids, labels=local_ids)
    output.loss.backward()
    average_gradients(model, mesh, batch_dims=batch_dims)
    reference_output = reference(input_ids=ids, labels=ids)
    reference_output.loss.backward()
    return output, reference_output


def worst_over_ranks(errors_per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """The largest of each named error over the ranks (as ``run_on_ranks`` returns them).

    Example::

        print("worst over ranks", worst_over_ranks(run_on_ranks(step_errors_of_rank, 4)))
    """
    return {key: max(errors[key] for errors in errors_per_rank) for key in errors_per_rank[0]}


def assert_ranks_within(
    errors_per_rank: Sequence[dict[str, float]], label: str, rtol: float = EXPERT_PARALLEL_RTOL
) -> None:
    """Print the worst errors over the ranks (the measured noise, under ``pytest -s``), then raise
    ``AssertionError`` naming the first rank with an error above ``rtol``.

    Example::

        assert_ranks_within(run_on_ranks(step_errors_of_rank, 4), label="mixtral ep4")
    """
    print(f"{label}: worst over ranks", worst_over_ranks(errors_per_rank))
    for rank, errors in enumerate(errors_per_rank):
        if max(errors.values()) > rtol:
            raise AssertionError(f"{label}, rank {rank}: an error above {rtol:.0e}: {errors}")
