"""The training runs behind dpipe's acceptance table, shared by its tests and ``tools/dpipe_accuracy.py``.

Every run trains a tiny ``transformers`` Llama (untied) or GPT-2 (``wte`` tied to ``lm_head``)
with eight blocks for :data:`STEPS` AdamW steps on the same :data:`GLOBAL_BATCH` x
:data:`SEQ_LEN` token batches and returns the loss of each step; one plain SGD step of the
same parallel model reads back the first step's gradients (``sgd_step_gradients``). The
reference is the test kit's (:func:`vescale.dtensor.testing.reference.train_reference`): the
same model, seed and batches in one process (float32, one thread), each step on the whole
batch. The parallel run composes, in this order: ``vescale.dmodule.parallelize_module``
over ``tp`` (its automatic plan), :func:`vescale.dpipe.pipeline_parallelize` over ``pp``,
then ``vescale.doptim.data_parallel`` over ``dp``, and trains with the test kit's plain
loop (``train_steps``). Every row has the same number of tokens, so the mean of
micro-batch (and dp-shard) mean losses is the whole batch's mean loss and the runs agree
up to float32 summation order.

``transformers`` is a test dependency: it is imported only when a model is built.

Example::

    losses = run_on_ranks(pipeline_training_losses, 4, args=("llama", {"pp": 2, "tp": 2}, plan_dict))
    reference = reference_training_run("llama")
    print(max_relative_error(losses[0], reference.losses))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from vescale.dpipe.pipeline_module import pipeline_parallelize
from vescale.dpipe.plan import PipelinePlan
from vescale.dtensor.testing.numerics import full_parameters, sgd_step_gradients
from vescale.dtensor.testing.reference import ReferenceRun, train_reference, train_steps

__all__ = [
    "ACCEPTANCE_CASES",
    "GLOBAL_BATCH",
    "LOSS_RTOL",
    "SCHEDULES",
    "SEQ_LEN",
    "SGD_LR",
    "STEPS",
    "assert_every_schedule_matches_single_device",
    "build_model",
    "max_relative_error",
    "pipeline_first_step_gradients",
    "pipeline_losses_and_gradients_per_schedule",
    "pipeline_training_losses",
    "pipeline_training_losses_per_schedule",
    "reference_training_losses",
    "reference_training_run",
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
# The SGD step that reads gradients back: large, so the parameters' own rounding adds only
# ulp / lr to the read-back gradient.
SGD_LR = 1e3


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


def _loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    return loss


def _pipe_loss(pipe: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = pipe(input_ids=input_ids, labels=input_ids).loss
    return loss


def reference_training_run(model_name: str) -> ReferenceRun:
    """Single-process training on the whole batch (the test kit's ``train_reference``: float32,
    one thread): each step's loss, gradients and optimizer state.

    Example::

        reference = reference_training_run("llama")
        assert len(reference.losses) == STEPS and "lm_head.weight" in reference.gradients[0]
    """
    return train_reference(
        lambda: build_model(model_name),
        training_batches(_vocab_size(build_model(model_name))),
        lambda model: _optimizer(model.parameters()),
        loss_fn=_loss,
    )


def reference_training_losses(model_name: str) -> list[float]:
    """The loss of each step of :func:`reference_training_run`.

    Example::

        reference = reference_training_losses("llama")
        assert len(reference) == STEPS
    """
    return reference_training_run(model_name).losses


@dataclass(frozen=True)
class _ParallelRun:
    model: nn.Module  # the model as built, under its wrappers: its FQNs are the reference's
    pipe: nn.Module
    optimizer: Any  # a torch optimizer, or doptim's DistributedOptimizer around one under dp
    mesh: Any
    dp_size: int
    dp_rank: int

    def local_batches(self, batches: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """This dp rank's contiguous rows of each global batch."""
        rows = GLOBAL_BATCH // self.dp_size
        return [input_ids[self.dp_rank * rows : (self.dp_rank + 1) * rows] for input_ids in batches]


def _parallelize(
    model_name: str,
    mesh_dims: dict[str, int],
    plan_dict: dict[str, Any],
    zero_stage: int,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
) -> _ParallelRun:
    from vescale.dtensor import init_mesh

    # mesh_dims holds only dim sizes, never init_mesh's device_type keyword.
    mesh = init_mesh(**cast(dict[str, Any], mesh_dims))
    model = build_model(model_name)
    if "tp" in mesh_dims:
        import vescale.dmodule

        # TP first: every parameter becomes a DTensor on the full mesh, then dpipe keeps this pp
        # rank's stages and drops the others' parameters.
        # The automatic plan, as a user runs it: it keeps GPT-2's tied embedding and head together.
        plan = vescale.dmodule.auto_sharding_plan(model)
        vescale.dmodule.parallelize_module(model, mesh, plan, mesh_dim="tp")
    pipe = pipeline_parallelize(model, mesh, PipelinePlan.from_dict(plan_dict))
    if "dp" not in mesh_dims:
        return _ParallelRun(model, pipe, optimizer_fn(pipe.parameters()), mesh, 1, 0)
    from vescale.doptim import DistributedOptimizer, data_parallel

    data_parallel(pipe, mesh, zero_stage=zero_stage, mesh_dim="dp")
    optimizer = DistributedOptimizer(optimizer_fn(pipe.parameters()))
    return _ParallelRun(model, pipe, optimizer, mesh, mesh_dims["dp"], mesh.get_local_rank("dp"))


def pipeline_training_losses(
    model_name: str, mesh_dims: dict[str, int], plan_dict: dict[str, Any], zero_stage: int = 1
) -> list[float]:
    """Run on every rank of ``mesh_dims`` (``pp``, optionally ``dp``/``tp``): each step's batch loss.

    With ``dp`` the model is ``data_parallel(..., zero_stage=zero_stage)`` with a
    ``DistributedOptimizer``, and the returned loss is the mean over the dp ranks' halves.

    Example::

        losses = run_on_ranks(pipeline_training_losses, 4, args=("gpt2", {"pp": 2, "tp": 2}, plan_dict))
    """
    run = _parallelize(model_name, mesh_dims, plan_dict, zero_stage, _optimizer)
    batches = run.local_batches(training_batches(_vocab_size(run.model)))
    losses = torch.tensor(train_steps(run.pipe, run.optimizer, batches, _pipe_loss), dtype=torch.float32)
    if run.dp_size > 1:
        dist.all_reduce(losses, group=run.mesh.get_group("dp"))
        losses /= run.dp_size
    return cast(list[float], losses.tolist())


def pipeline_first_step_gradients(
    model_name: str, mesh_dims: dict[str, int], plan_dict: dict[str, Any], zero_stage: int = 1
) -> dict[str, torch.Tensor]:
    """Run on every rank of ``mesh_dims``: the first batch's gradients of this rank's stages by FQN,
    read back from one plain SGD step (``sgd_step_gradients``) of the same parallel model: what the
    optimizer applied after the micro-batch accumulation, the tied copies' sum and dp's reduction.

    Example::

        gradients = run_on_ranks(pipeline_first_step_gradients, 2, args=("llama", {"pp": 2}, plan_dict))
    """

    def sgd(parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=SGD_LR)

    run = _parallelize(model_name, mesh_dims, plan_dict, zero_stage, sgd)
    first = run.local_batches(training_batches(_vocab_size(run.model))[:1])
    before = full_parameters(run.model)
    train_steps(run.pipe, run.optimizer, first, _pipe_loss)
    return sgd_step_gradients(before, full_parameters(run.model), SGD_LR)


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


def pipeline_losses_and_gradients_per_schedule(
    model_name: str, mesh_dims: dict[str, int], schedules: tuple[str, ...]
) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    """Per schedule, :func:`pipeline_training_losses` and :func:`pipeline_first_step_gradients`.

    Example::

        dims = {"pp": 2, "tp": 2}
        runs = run_on_ranks(pipeline_losses_and_gradients_per_schedule, 4, args=("gpt2", dims, SCHEDULES))
    """
    losses = pipeline_training_losses_per_schedule(model_name, mesh_dims, schedules)
    return {
        schedule: (
            losses[schedule],
            pipeline_first_step_gradients(model_name, mesh_dims, schedule_plan(schedule, mesh_dims["pp"])),
        )
        for schedule in schedules
    }


def assert_every_schedule_matches_single_device(
    model_name: str, mesh_dims: dict[str, int], grad_rtol: float, timeout_s: float = 400
) -> None:
    """On ``mesh_dims`` ranks, every schedule's step losses (``LOSS_RTOL``) and every first-step
    gradient (``grad_rtol``) against :func:`reference_training_run`; prints the worst of each.

    Example::

        assert_every_schedule_matches_single_device("gpt2", {"pp": 2, "tp": 2}, grad_rtol=1e-5)
    """
    from vescale.dtensor.testing import run_on_ranks
    from vescale.dtensor.testing.reference import assert_matches_reference

    reference = reference_training_run(model_name)
    results = run_on_ranks(
        pipeline_losses_and_gradients_per_schedule,
        world_size=math.prod(mesh_dims.values()),
        args=(model_name, mesh_dims, SCHEDULES),
        timeout_s=timeout_s,
    )
    layout = " x ".join(f"{name}{size}" for name, size in mesh_dims.items())
    for schedule in SCHEDULES:
        losses, gradients = zip(*(per_schedule[schedule] for per_schedule in results), strict=True)
        assert all(gradients), f"a rank holds no parameter under {schedule}"
        label = f"{model_name} {layout} {schedule}"
        errors = assert_matches_reference(
            reference, losses, gradients, loss_rtol=LOSS_RTOL, grad_rtol=grad_rtol, label=label
        )
        print(f"{label}: worst loss error {errors[0]:.2e}, first-step gradient {errors[1]:.2e}")
