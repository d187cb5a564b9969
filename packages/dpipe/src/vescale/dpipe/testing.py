"""The training runs behind dpipe's acceptance table, shared by its tests and ``tools/dpipe_accuracy.py``.

Every run trains a tiny ``transformers`` Llama (untied) or GPT-2 (``wte`` tied to ``lm_head``)
with eight blocks for :data:`STEPS` AdamW steps on the same :data:`GLOBAL_BATCH` x
:data:`SEQ_LEN` token batches and returns the loss of each step. The reference is the
same model, seed and batches in one process (float32, one thread), each step on the whole
batch. The parallel run composes, in this order: ``vescale.dmodule.parallelize_module``
over ``tp`` (its automatic plan), :func:`vescale.dpipe.pipeline_parallelize` over ``pp``,
then ``vescale.doptim.data_parallel`` over ``dp``. Every row has the same number of
tokens, so the mean of micro-batch (and dp-shard) mean losses is the whole batch's mean
loss and the runs agree up to float32 summation order.

``transformers`` is a test dependency: it is imported only when a model is built.

Example::

    losses = run_on_ranks(pipeline_training_losses, 4, args=("llama", {"pp": 2, "tp": 2}, plan_dict))
    reference = reference_training_losses("llama")
    print(max_relative_error(losses[0], reference))
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from vescale.dpipe.pipeline_module import pipeline_parallelize
from vescale.dpipe.plan import PipelinePlan

__all__ = [
    "ACCEPTANCE_CASES",
    "GLOBAL_BATCH",
    "LOSS_RTOL",
    "SCHEDULES",
    "SEQ_LEN",
    "STEPS",
    "build_model",
    "max_relative_error",
    "pipeline_training_losses",
    "pipeline_training_losses_per_schedule",
    "reference_training_losses",
    "schedule_plan",
    "training_batches",
]

STEPS = 10
GLOBAL_BATCH = 16
SEQ_LEN = 8
LEARNING_RATE = 1e-2
# The bound on every step's loss against single-device training.
LOSS_RTOL = 1e-4
NUM_MICROBATCHES = 4


def schedule_plan(schedule: str, pp_size: int) -> dict[str, Any]:
    """The ``PipelinePlan`` dict of the acceptance runs: 4 micro-batches, 2 virtual stages where allowed.

    Example::

        plan = PipelinePlan.from_dict(schedule_plan("zbv", 2))
        assert plan.num_stages == 4
    """
    virtual_stages = 1 if schedule in ("gpipe", "1f1b") else 2
    return dict(
        size=pp_size, schedule=schedule, num_microbatches=NUM_MICROBATCHES, virtual_stages=virtual_stages
    )


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
# (model name, mesh dims, PipelinePlan dict): the rows of tools/dpipe_accuracy.py's table.
ACCEPTANCE_CASES: list[tuple[str, dict[str, int], dict[str, Any]]] = [
    (model_name, mesh_dims, schedule_plan(schedule, mesh_dims["pp"]))
    for model_name in ("llama", "gpt2")
    for mesh_dims in ({"pp": 2}, {"pp": 4}, {"pp": 2, "tp": 2})
    for schedule in SCHEDULES
] + [
    (model_name, {"pp": 2, "dp": 2, "tp": 2}, schedule_plan(schedule, 2))
    for model_name in ("llama", "gpt2")
    for schedule in ("1f1b", "zbv")
]


def build_model(model_name: str) -> nn.Module:
    """Tiny Llama (untied) or GPT-2 (tied) with eight blocks: enough for PP=4 x 2 virtual stages.

    Example::

        model = build_model("gpt2")
        assert model.lm_head.weight is model.transformer.wte.weight
    """
    from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model

    if model_name == "gpt2":
        return build_tiny_hf_model("gpt2", n_layer=8, tie_word_embeddings=True)
    return build_tiny_hf_model("llama", num_hidden_layers=8)


def _vocab_size(model: nn.Module) -> int:
    # A transformers model; nn.Module's __getattr__ types ``config`` as Tensor | Module.
    config: Any = model.config
    return int(config.vocab_size)


def training_batches(vocab_size: int) -> list[torch.Tensor]:
    """The token batches of the :data:`STEPS` steps (labels are the inputs; the model shifts them).

    Example::

        batches = training_batches(64)
        assert batches[0].shape == (GLOBAL_BATCH, SEQ_LEN)
    """
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(STEPS)]


def _optimizer(parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=LEARNING_RATE)


def reference_training_losses(model_name: str) -> list[float]:
    """The loss of each step of single-process training on the whole batch (float32, one thread).

    Example::

        reference = reference_training_losses("llama")
        assert len(reference) == STEPS
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(model_name)
        optimizer = _optimizer(model.parameters())
        losses = []
        for input_ids in training_batches(_vocab_size(model)):
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses
    finally:
        torch.set_num_threads(threads)


def pipeline_training_losses(
    model_name: str, mesh_dims: dict[str, int], plan_dict: dict[str, Any], zero_stage: int = 1
) -> list[float]:
    """Run on every rank of ``mesh_dims`` (``pp``, optionally ``dp``/``tp``): each step's batch loss.

    With ``dp`` the model is ``data_parallel(..., zero_stage=zero_stage)`` with a
    ``DistributedOptimizer``, and the returned loss is the mean over the dp ranks' halves.

    Example::

        losses = run_on_ranks(pipeline_training_losses, 4, args=("gpt2", {"pp": 2, "tp": 2}, plan_dict))
    """
    from vescale.dtensor import init_mesh

    # mesh_dims holds only dim sizes, never init_mesh's device_type keyword.
    mesh = init_mesh(**cast(dict[str, Any], mesh_dims))
    model = build_model(model_name)
    if "tp" in mesh_dims:
        import vescale.dmodule

        # TP first: every parameter becomes a DTensor on the full mesh, then dpipe keeps this pp
        # rank's stages and drops the others' parameters.
        vescale.dmodule.parallelize_module(model, mesh, _tensor_parallel_plan(model), mesh_dim="tp")
    pipe = pipeline_parallelize(model, mesh, PipelinePlan.from_dict(plan_dict))
    if "dp" in mesh_dims:
        from vescale.doptim import DistributedOptimizer, data_parallel

        data_parallel(pipe, mesh, zero_stage=zero_stage, mesh_dim="dp")
        optimizer: DistributedOptimizer | torch.optim.Optimizer = DistributedOptimizer(
            _optimizer(pipe.parameters())
        )
        dp_size, dp_rank = mesh_dims["dp"], mesh.get_local_rank("dp")
    else:
        optimizer = _optimizer(pipe.parameters())
        dp_size, dp_rank = 1, 0
    rows = GLOBAL_BATCH // dp_size
    losses = []
    for input_ids in training_batches(_vocab_size(model)):
        local_ids = input_ids[dp_rank * rows : (dp_rank + 1) * rows]
        out = pipe(input_ids=local_ids, labels=local_ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = out.loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            loss /= dp_size
        losses.append(loss.item())
    return losses


def _tensor_parallel_plan(model: nn.Module) -> dict[str, Any]:
    """dmodule's automatic plan, with the input embedding of a tied model given its head's placement.

    On a tied GPT-2 the automatic plan sees the shared table once, under ``lm_head.weight``
    (vocabulary-sharded ``S(0)``), and leaves ``transformer.wte.weight`` out, which
    ``parallelize_module`` rejects (one tied tensor, two placements). Naming the embedding
    with the same placement, and its output Replicate, is the plan a user would write.
    """
    import vescale.dmodule

    plan = vescale.dmodule.auto_sharding_plan(model).to_dict()
    hf_model: Any = model  # a transformers model; nn.Module's __getattr__ hides its methods' types
    input_embedding, output_embedding = hf_model.get_input_embeddings(), hf_model.get_output_embeddings()
    if output_embedding is not None and input_embedding.weight is output_embedding.weight:
        names = {module: fqn for fqn, module in model.named_modules()}
        head_placement = next(
            placement
            for pattern, placement in plan["parameter"].items()
            if pattern.startswith(re.escape(names[output_embedding]))
        )
        embedding_fqn = names[input_embedding]
        plan["parameter"][re.escape(embedding_fqn) + r"\.weight"] = head_placement
        plan["forward"][re.escape(embedding_fqn) + ".output"] = ["R"]
    return plan


def pipeline_training_losses_per_schedule(
    model_name: str, mesh_dims: dict[str, int], schedules: tuple[str, ...]
) -> dict[str, list[float]]:
    """:func:`pipeline_training_losses` for several schedules in one rank call (one process start-up).

    Example::

        runs = run_on_ranks(pipeline_training_losses_per_schedule, 2, args=("llama", {"pp": 2}, ("1f1b",)))
    """
    return {
        schedule: pipeline_training_losses(model_name, mesh_dims, schedule_plan(schedule, mesh_dims["pp"]))
        for schedule in schedules
    }


def max_relative_error(losses: list[float], reference: list[float]) -> float:
    """The worst per-step ``|loss - reference| / |reference|`` over the steps.

    Example::

        assert max_relative_error([1.0, 2.0], [1.0, 2.0]) == 0.0
    """
    return max(abs(loss - expected) / abs(expected) for loss, expected in zip(losses, reference, strict=True))
