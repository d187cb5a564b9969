"""A tiny ``transformers`` architecture under a 2-stage pipeline against one process, for dpipe's tests.

The parallel run cuts the model (built by ``build_tiny_causal_lm(arch, seed=0)``: the
architecture's own defaults, sizes shrunk) into 2 stages of 2 micro-batches and trains on
2 ranks (4 with ``tensor_parallel``: dmodule's automatic plan over ``tp=2`` first); the
reference trains the same model on the whole batch in one process
(:func:`vescale.dtensor.testing.reference.train_reference`). Compared: every step's loss on
every rank and every parameter's first-step gradient. AdamW, or SGD under tensor parallelism.

``transformers`` is a test dependency: it is imported only when a model is built.

Example::

    batches = architecture_batches(steps=4, id_limit=96)
    loss_error, gradient_error = assert_pipeline_matches_single_device("bloom", batches)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vescale.dpipe.pipeline_module import pipeline_parallelize
from vescale.dpipe.plan import PipelinePlan
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import full_gradients
from vescale.dtensor.testing.reference import assert_matches_reference, train_reference

__all__ = ["architecture_batches", "assert_pipeline_matches_single_device", "build_architecture"]


def architecture_batches(steps: int, id_limit: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of 4 x 8 token ids below ``id_limit``, each its own labels.

    Example::

        batches = architecture_batches(steps=2, id_limit=96)
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        input_ids = torch.randint(0, id_limit, (4, 8), generator=generator)
        batches.append({"input_ids": input_ids, "labels": input_ids})
    return batches


def build_architecture(arch: str) -> nn.Module:
    """The tiny ``arch`` of the sweep (its defaults kept, sizes shrunk), seeded 0."""
    from vescale.dtensor.testing.models.hf_architectures import build_tiny_causal_lm

    return build_tiny_causal_lm(arch, seed=0)


def _optimizer(parameters: Any, tensor_parallel: bool) -> torch.optim.Optimizer:
    if tensor_parallel:
        return torch.optim.SGD(parameters, lr=0.5)
    return torch.optim.AdamW(parameters, lr=1e-2)


def _pipeline_run(
    arch: str, batches: list[dict[str, torch.Tensor]], zero_stage: int | None, tensor_parallel: bool
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each step's loss and the first step's gradients (read before the optimizer steps)."""
    from vescale.dtensor import init_mesh

    model = build_architecture(arch)
    plan = PipelinePlan(size=2, num_microbatches=2)
    if tensor_parallel:
        import vescale.dmodule

        mesh = init_mesh(pp=2, tp=2)
        plan_of_model = vescale.dmodule.auto_sharding_plan(model)
        vescale.dmodule.parallelize_module(model, mesh, plan_of_model, mesh_dim="tp")
        pipe: nn.Module = pipeline_parallelize(model, mesh, plan)
        optimizer = _optimizer(pipe.parameters(), tensor_parallel)
    elif zero_stage is None:
        pipe = pipeline_parallelize(model, None, plan)
        optimizer = _optimizer(pipe.parameters(), tensor_parallel)
    else:
        from vescale.doptim import DistributedOptimizer, data_parallel

        mesh = init_mesh(pp=2, dp=1)
        pipe = data_parallel(
            pipeline_parallelize(model, mesh, plan), mesh, zero_stage=zero_stage, mesh_dim="dp"
        )
        optimizer = DistributedOptimizer(_optimizer(pipe.parameters(), tensor_parallel))
    losses, first_gradients = [], {}
    for step, batch in enumerate(batches):
        optimizer.zero_grad()
        loss = pipe(**batch).loss
        loss.backward()
        if step == 0:
            if zero_stage is not None:
                optimizer.prepare_grads()  # type: ignore[attr-defined]  # a DistributedOptimizer
            first_gradients = full_gradients(model)
        optimizer.step()
        losses.append(loss.item())
    return losses, first_gradients


def assert_pipeline_matches_single_device(
    arch: str,
    batches: list[dict[str, torch.Tensor]],
    zero_stage: int | None = None,
    tensor_parallel: bool = False,
    loss_rtol: float = 1e-4,
    grad_rtol: float = 1e-5,
) -> tuple[float, float]:
    """``arch`` under pp2 (ZeRO-``zero_stage`` over dp1, or tp2, when given) against one process.

    Returns the worst relative loss and first-step gradient errors (and prints them).

    Example::

        assert_pipeline_matches_single_device("zamba2", architecture_batches(4, 96), tensor_parallel=True)
    """
    reference = train_reference(
        lambda: build_architecture(arch),
        batches,
        lambda model: _optimizer(model.parameters(), tensor_parallel),
    )
    results = run_on_ranks(
        _pipeline_run,
        world_size=4 if tensor_parallel else 2,
        args=(arch, batches, zero_stage, tensor_parallel),
        timeout_s=180,
    )
    losses, gradients = zip(*results, strict=True)
    label = f"{arch} pp2" + (" tp2" if tensor_parallel else "" if zero_stage is None else " dp1")
    errors = assert_matches_reference(
        reference, losses, gradients, loss_rtol=loss_rtol, grad_rtol=grad_rtol, label=label
    )
    print(f"{label}: worst loss error {errors[0]:.2e}, first-step gradient {errors[1]:.2e}")
    return errors
