"""``vescale.parallelize``: hand each section of a :class:`~vescale.planner.Plan` to the package that owns it.

Order of composition (each step needs the previous one's placements):

1. the mesh ``init_mesh(dp=, tp=)`` over the default process group (plus ``pp`` and ``ep`` when used);
2. tensor/sequence parallelism (dmodule, ``plan.sharding_plan`` over ``tp``): every parameter
   becomes a DTensor on the whole mesh; a model from :func:`vescale.deferred_init` is
   materialised here, each rank allocating only its tp shards (without tp: full tensors);
   with ``ep > 1`` the plan's expert entries are left out (``expert_tensor_parallel`` off; on,
   they split each expert over tp first, then over ep) and
   the experts of every MoE block are sharded over ``ep`` (``parallelize_experts``: E/ep whole
   experts per rank, tokens dispatched by all-to-all, the load-balancing loss of the global batch;
   with experts replicated over dp, the load-balancing loss is made the global batch's too);
3. mixed precision ``"bf16"``: parameters and activations in bfloat16 (the optimizer keeps fp32
   master weights and state, step 6);
4. activation checkpointing ``"full"`` or ``"selective"`` on every repeated block;
5. pipeline stages (dpipe, ``plan.pipeline`` over ``pp``);
6. data parallelism and ZeRO (doptim, ``plan.data_parallel`` over ``dp``, or over dp x ep with
   expert parallelism: experts reduced over dp only), then the optimizer
   ``DistributedOptimizer(optimizer_fn(model))`` and ``lr_scheduler_fn(optimizer)``;
7. the returned model (:class:`~._global_batch.ParallelizedModel`): one call takes this rank's
   share of the global batch and returns the whole global batch's loss; ``compile=True`` runs
   the model under ``torch.compile`` (with tensor parallelism, each repeated block separately).

Example::

    plan = vescale.generate_plan(model, {"tensor_parallel.size": 2})
    model, optimizer, scheduler, loader = vescale.parallelize(plan, model, optimizer_fn, None, dataset)
    for batch in loader: model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from vescale.api._global_batch import ParallelizedModel
from vescale.api._plain_outputs import plain_outputs_without_grad
from vescale.api._recompute import checkpoint_repeated_blocks
from vescale.api.errors import ParallelizeError, PlanMismatchError, UnsupportedPlanError, WorldSizeError
from vescale.dmodule import DModuleError, materialize_module, parallelize_module
from vescale.dmodule.experts import (
    attach_global_aux_loss,
    find_moe_blocks,
    parallelize_experts,
    tensor_parallel_outside_experts,
)
from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.doptim import DistributedOptimizer, data_parallel
from vescale.dpipe import PipelineError, pipeline_parallelize
from vescale.dtensor import init_mesh, is_deferred
from vescale.planner import Plan

__all__ = ["mesh_of", "parallelize"]

OptimizerFn = Callable[[nn.Module], Optimizer]
LRSchedulerFn = Callable[[Optimizer], Any]


def mesh_of(model: nn.Module) -> DeviceMesh:
    """The mesh ``vescale.parallelize`` built for ``model`` (the model it returned).

    Example::

        model, optimizer, _, _ = vescale.parallelize(plan, model, optimizer_fn)
        dp_rank = mesh_of(model).get_local_rank("dp")
    """
    if not isinstance(model, ParallelizedModel):
        raise ParallelizeError(
            f"{type(model).__name__} is not a model returned by vescale.parallelize; pass that one"
        )
    return model.mesh


def _check_pipeline_zero(plan: Plan) -> None:
    if isinstance(plan, Plan) and plan.pipeline is not None and plan.data_parallel.zero_stage == 3:
        # dpipe re-delivers each stage's gradients after the schedule (vescale.dpipe.gradients);
        # FSDP2's sharded parameters do not take them (a DTensor/Tensor mix in the first backward).
        raise UnsupportedPlanError(
            f"ZeRO-3 under a pipeline (pp={plan.mesh_size('pp')}, data_parallel.zero_stage=3) is not "
            "supported; use zero.stage 1 or 2 with the pipeline (each shards the optimizer state over "
            "dp), or ZeRO-3 without one (pipeline_parallel.size=1)"
        )


def _check_compile(plan: Plan, model: nn.Module) -> None:
    if isinstance(plan, Plan) and plan.mesh_size("ep") > 1 and plan.mesh_size("tp") > 1:
        # The MoE block's compiled code before the (eager) dispatch returns a view of its DTensor
        # input, which AOT autograd regenerates with as_strided, which DTensor refuses (torch 2.13).
        raise UnsupportedPlanError(
            f"compile=True with expert parallelism and tensor parallelism (ep={plan.mesh_size('ep')}, "
            f"tp={plan.mesh_size('tp')}) fails in torch.compile (as_strided of a DTensor view around the "
            "eager token dispatch, torch 2.13); use compile=False, or compile with tp=1 (ep and dp only)"
        )
    # torch 2.13: DTensor's bmm sharding propagation on a _StridedShard needs concrete values under
    # the fake tensors of a compile, so eager attention on a dp x tp mesh fails in its first call.
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if (
        isinstance(plan, Plan)
        and plan.mesh_size("tp") > 1
        and plan.mesh_size("dp") > 1
        and attention == "eager"
    ):
        raise UnsupportedPlanError(
            f"compile=True with {type(model).__name__}'s eager attention on a dp x tp mesh "
            f"(dp={plan.mesh_size('dp')}, tp={plan.mesh_size('tp')}) fails in torch.compile (DTensor's "
            "bmm sharding propagation under fake tensors, torch 2.13); build the model with "
            "attn_implementation='sdpa', or use compile=False"
        )


def _check_world(plan: Plan) -> None:
    if not isinstance(plan, Plan):
        raise ParallelizeError(
            f"parallelize takes a vescale.Plan first (the argument order is plan, model), got "
            f"{type(plan).__name__}; build one with vescale.generate_plan(model, constraints)"
        )
    if not dist.is_initialized():
        raise WorldSizeError(
            f"the plan needs {plan.world_size} processes, but torch.distributed is not initialised; start "
            "the script with torchrun --nproc-per-node N and call torch.distributed.init_process_group()"
        )
    if dist.get_world_size() != plan.world_size:
        mesh = " x ".join(f"{dim}{size}" for dim, size in plan.mesh if size > 1) or "1 device"
        raise WorldSizeError(
            f"the plan's mesh {mesh} needs world size {plan.world_size}, but the process group has "
            f"{dist.get_world_size()} ranks; run on {plan.world_size} ranks or regenerate the plan with "
            f"vescale.generate_plan(model, constraints, world_size={dist.get_world_size()})"
        )


def _mesh_dims(plan: Plan) -> dict[str, int]:
    """The plan's mesh without its unused ``pp``/``ep`` dims (``dp`` and ``tp`` always, as doptim and
    dmodule address them by name).

    DTensor expands every op's sharding strategies over each mesh dim: two extra dims of size 1
    made a dp2 x tp2 Llama step ~100x slower on CPU (measured: 40 s vs 0.3 s).
    """
    return {dim: size for dim, size in plan.mesh if size > 1 or dim in ("dp", "tp")}


def _batch_dims(plan: Plan) -> str | tuple[str, ...]:
    """The mesh dims the batch is split over (the data-parallel group): dp, and ep when used."""
    return ("dp", "ep") if plan.mesh_size("ep") > 1 else "dp"


def _tensor_parallel_plan(plan: Plan, model: nn.Module) -> ShardingPlan | dict[str, Any] | None:
    """The sharding plan to apply over tp: the plan's, without the experts when they are not split over tp."""
    ep = plan.mesh_size("ep")
    if plan.sharding_plan is None:
        # ZeRO-3 over dp x ep shards DTensor parameters on the mesh: make every parameter one (Replicate).
        return {"parameter": {}} if ep > 1 and plan.data_parallel.zero_stage == 3 else None
    if plan.experts_split_over_tp:
        return plan.sharding_plan
    try:
        return tensor_parallel_outside_experts(plan.sharding_plan, model)
    except DModuleError as error:
        raise PlanMismatchError(f"plan.sharding_plan cannot leave the experts to mesh.ep: {error}") from error


def _apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, sharding_plan: ShardingPlan | dict[str, Any] | None
) -> None:
    if sharding_plan is None:
        if any(is_deferred(tensor) for tensor in [*model.parameters(), *model.buffers()]):
            materialize_module(model)
        return
    try:
        parallelize_module(model, mesh, sharding_plan, mesh_dim="tp")
    except DModuleError as error:
        raise PlanMismatchError(
            f"plan.sharding_plan does not fit {type(model).__name__} (was the plan made for another "
            f"model?): {error}. Regenerate it with vescale.generate_plan(model, constraints)"
        ) from error


def _apply_pipeline(plan: Plan, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    if plan.pipeline is None:  # called for plans with a pipeline section only
        raise ParallelizeError("the plan has no pipeline section to apply; give it one, or mesh.pp=1")
    # The split's fake-tensor pass at the plan's sequence length: one the model accepts (Reformer
    # trains only at the product of its axial position shape, which the planner chose).
    example_batch = {"input_ids": torch.zeros(1, plan.sequence_length, dtype=torch.long)}
    try:
        return pipeline_parallelize(model, mesh, plan.pipeline, example_batch)
    except PipelineError as error:
        raise PlanMismatchError(
            f"plan.pipeline does not fit {type(model).__name__}: {error}. Regenerate the plan with "
            "vescale.generate_plan(model, constraints)"
        ) from error


@contextlib.contextmanager
def _experts_held_out(model: nn.Module) -> Iterator[None]:
    """The MoE blocks' expert parameters taken out of their modules for the block, then put back (in
    their order: an experts module holds only them)."""
    held = []
    for block in find_moe_blocks(model):
        experts = model.get_submodule(block.experts_fqn)
        held += [(experts, name, experts._parameters.pop(name)) for name in block.expert_parameters]
    try:
        yield
    finally:
        for experts, name, param in held:
            experts._parameters[name] = param


def _apply_expert_parallel(plan: Plan, model: nn.Module, mesh: DeviceMesh) -> None:
    try:
        parallelize_experts(model, mesh, ep_dim="ep", capacity_factor=plan.capacity_factor)
    except DModuleError as error:
        raise PlanMismatchError(
            f"plan mesh.ep={plan.mesh_size('ep')} does not fit {type(model).__name__}: {error}"
        ) from error


def _apply_data_parallel(plan: Plan, model: nn.Module, mesh: DeviceMesh) -> None:
    section = plan.data_parallel
    if section.zero_stage == 3:
        # FSDP2 keeps the sharded parameters in fp32 (the master weights) and computes in bf16.
        compute_dtype = torch.bfloat16 if plan.mixed_precision == "bf16" else None
        data_parallel(
            model,
            mesh,
            zero_stage=3,
            mesh_dim=_batch_dims(plan),
            compute_dtype=compute_dtype,
            deterministic=section.deterministic,
        )
        return
    data_parallel(
        model,
        mesh,
        zero_stage=section.zero_stage,
        mesh_dim=_batch_dims(plan),
        bucket_size_mb=section.bucket_size_mb,
        deterministic=section.deterministic,
        grad_dtype=torch.float32,
    )


def _parallel_module(plan: Plan, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    expert_parallel = plan.mesh_size("ep") > 1
    sharding_plan = _tensor_parallel_plan(plan, model)
    if (
        expert_parallel
        and not plan.experts_split_over_tp
        and any(is_deferred(param) for param in model.parameters())
    ):
        # A deferred model: the rest is materialised (TP shards or full tensors) with the experts held
        # out, then each rank materialises its own experts only. (Split over tp too, the experts are
        # materialised as their tp slices of every expert, then cut to this rank's over ep.)
        with _experts_held_out(model):
            _apply_tensor_parallel(model, mesh, sharding_plan)
    else:
        _apply_tensor_parallel(model, mesh, sharding_plan)
    if expert_parallel:
        _apply_expert_parallel(plan, model, mesh)
    elif plan.mesh_size("dp") > 1:
        # Experts replicated over dp: the load-balancing loss is still the global batch's (transformers
        # computes it from each rank's own tokens, which is not the single-device loss). Under a
        # pipeline, dpipe carries the statistics from stage to stage and the last stage's hook uses them.
        attach_global_aux_loss(model, mesh, batch_dims=("dp",))
    if plan.mixed_precision == "bf16" and plan.data_parallel.zero_stage < 3:
        model.to(torch.bfloat16)
    if plan.activation_checkpointing != "none":
        checkpoint_repeated_blocks(model, plan.activation_checkpointing)
    module = _apply_pipeline(plan, model, mesh) if plan.pipeline is not None else model
    _apply_data_parallel(plan, module, mesh)
    return module


def parallelize(
    plan: Plan,
    model: nn.Module,
    optimizer_fn: OptimizerFn | None = None,
    lr_scheduler_fn: LRSchedulerFn | None = None,
    dataset: Any = None,
    *,
    compile: bool = False,
    **loader_kwargs: Any,
) -> tuple[ParallelizedModel, Optimizer | None, Any, Any]:
    """Apply ``plan`` to ``model`` on this rank; return ``(model, optimizer, lr_scheduler, data_loader)``.

    Needs an initialised default process group of ``plan.world_size`` ranks. ``optimizer_fn``
    receives the parallelized model (the user's own class; under a pipeline, this rank's
    stages) and its optimizer is wrapped in :class:`vescale.doptim.DistributedOptimizer`;
    ``lr_scheduler_fn`` receives that optimizer; ``dataset`` (with ``loader_kwargs``) becomes a
    :class:`vescale.DistributedDataLoader` of ``plan.global_batch_size``. Every rank gets the
    whole global batch's loss from ``model(**batch).loss``.

    ``plan.activation_checkpointing`` ``"full"`` or ``"selective"`` checkpoints each repeated
    block (``vescale.planner.selective`` says what selective keeps); training calls of such a
    model pass ``use_cache=False`` when its forward takes ``use_cache`` and the batch does not
    set it, as ``transformers``' own gradient checkpointing does (a recomputation would fill
    the KV cache twice).

    ``compile=True`` compiles the whole model with ``torch.compile``, except with tensor
    parallelism (``tp > 1``): then it compiles the ``forward`` of each repeated block (each
    element of the model's outermost ``nn.ModuleList``s, a transformer's layers, as torchtitan
    does), and the code around the blocks (embedding, final norm, head, loss) and the blocks' own
    dmodule placement hooks run eagerly. Whole-model compile fails there: dmodule's forward hooks
    enter vescale.dtensor's implicit-replication mode, and inductor cannot trace the DTensors it
    creates ("Mixing fake modes NYI", torch 2.13). Training calls of such a model pass
    ``use_cache=False`` when its forward takes ``use_cache`` and the batch does not set it (a
    compiled block cannot return a KV cache of DTensors that get no gradient), and the process's
    ``torch.compiler.config.recompile_limit`` is raised to 8 per block (the blocks share one code
    object; veScale's hooks inside them compile once for all blocks, a user's hook that differs
    between blocks may not). Inside a compiled block, sibling modules reading one tensor share
    its conversion, as in eager mode: a Llama block's backward all-reduces twice, not five times
    (:mod:`vescale.dmodule.compiled_blocks`). Known limit (torch 2.13): a transformers model with
    ``attn_implementation="eager"`` on a dp x tp mesh with more than one row per micro-batch fails
    to compile (DTensor's ``bmm`` sharding propagation on a ``_StridedShard`` needs concrete
    values under fake tensors); ``"sdpa"`` attention compiles. With expert parallelism the token
    dispatch runs eagerly inside the compiled model (``torch.compiler.disable``); ep with tp > 1
    is refused under compile (torch 2.13: AOT autograd replays a view of a DTensor with
    ``as_strided`` around the dispatch, which DTensor refuses).

    Example::

        model, optimizer, scheduler, loader = vescale.parallelize(plan, model, optimizer_fn, None, dataset)
        for batch in loader:
            model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
    """
    if compile:
        _check_compile(plan, model)
    _check_pipeline_zero(plan)
    _check_world(plan)
    # The mesh dims are sizes only, never init_mesh's device_type keyword.
    mesh = init_mesh(**cast(dict[str, Any], _mesh_dims(plan)))
    module = _parallel_module(plan, model, mesh)
    parallel_model = ParallelizedModel(
        module,
        mesh,
        num_microbatches=plan.num_microbatches,
        pipelined=plan.pipeline is not None,
        user_model=model,
    )
    plain_outputs_without_grad(model)  # generate and no-grad evaluation read plain logits
    if plan.activation_checkpointing != "none":
        parallel_model.turn_cache_off_in_training()
    if compile:
        parallel_model.compile_module(per_block=plan.mesh_size("tp") > 1)
    optimizer = DistributedOptimizer(optimizer_fn(module)) if optimizer_fn is not None else None
    lr_scheduler = None
    if lr_scheduler_fn is not None:
        if optimizer is None:
            raise ParallelizeError("lr_scheduler_fn needs an optimizer to schedule; pass optimizer_fn too")
        lr_scheduler = lr_scheduler_fn(optimizer)
    data_loader = None
    if dataset is not None:
        from vescale.api.data_loader import DistributedDataLoader

        data_loader = DistributedDataLoader(
            dataset, mesh, global_batch_size=plan.global_batch_size, dp_dim=_batch_dims(plan), **loader_kwargs
        )
    elif loader_kwargs:
        raise ParallelizeError(
            f"data loader options {sorted(loader_kwargs)} were given without a dataset; pass dataset too"
        )
    return parallel_model, optimizer, lr_scheduler, data_loader
