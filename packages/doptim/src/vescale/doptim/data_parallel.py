"""``data_parallel``: apply one ZeRO stage to a model, before its optimizer is built.

Stages 0-2 attach a :class:`~vescale.doptim.DDP` (bucketed gradient averaging; 2
reduce-scatters). Stage 3 shards the parameters over the dp mesh dim with PyTorch's FSDP2
``fully_shard``, one unit per element of every ``nn.ModuleList`` (the transformer blocks of
a ``transformers`` model; blocks that share parameters are one unit) plus the root;
parameters that are already DTensors on a dp×tp mesh (``vescale.dmodule``) are sharded in
place on that mesh (``DataParallelMeshDims``). A unit's inner modules called outside its
forward (a reversible layer's backward recomputation) gather its parameters first
(:mod:`~vescale.doptim.unit_reentry`).
FSDP2 works on CPU/gloo in torch 2.13 (its reduce-scatter included). ``deterministic=True``
swaps FSDP2's reduce-scatter for :class:`~vescale.doptim.reduction.RankOrderedReduceScatter`
(each gradient element summed in rank order, as under stages 0-2). ``compute_dtype=torch.bfloat16``
(stage 3) is mixed precision: the fp32 parameter shards are the master weights (so the
optimizer state is fp32 too), FSDP2 all-gathers them cast to bf16 for forward and backward,
and reduces the gradients in fp32. Then build the optimizer and wrap it:
``DistributedOptimizer(optimizer_fn(model))``.

Example::

    model = data_parallel(model, init_mesh(dp=4), zero_stage=2)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed.fsdp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from vescale.doptim import _compat
from vescale.doptim.ddp import DATA_PARALLEL_ATTRIBUTE, DDP, data_parallel_of, dp_mesh_dims
from vescale.doptim.errors import DataParallelConfigError, DataParallelMeshError
from vescale.doptim.mesh_groups import mesh_dim_names, mesh_dims_group
from vescale.doptim.reduction import RankOrderedReduceScatter
from vescale.doptim.unit_reentry import gather_on_reentry

__all__ = ["ZERO_STAGES", "FullyShardedState", "data_parallel"]

ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class FullyShardedState:
    """What ``data_parallel(..., zero_stage=3)`` did: FSDP2 over ``device_mesh[mesh_dim]``."""

    module: nn.Module
    device_mesh: DeviceMesh
    mesh_dim: str | tuple[str, ...]
    deterministic: bool = False
    compute_dtype: torch.dtype | None = None
    zero_stage: int = 3

    @property
    def dp_rank(self) -> int:
        """This rank's coordinate on the data-parallel mesh dim(s), flattened (outer first)."""
        if isinstance(self.mesh_dim, str):
            return self.device_mesh.get_local_rank(self.mesh_dim)
        return mesh_dims_group(self.device_mesh, self.mesh_dim)[2]

    def finish_grad_sync(self) -> None:
        """FSDP2 reduce-scatters during backward and waits at its end: nothing is left to do."""


def _fully_shard_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """Every element of every outermost ``nn.ModuleList`` (the blocks), then the root.

    A list inside a block (LongCat-Flash's two attentions per layer) is left to its block's
    unit: FSDP2 shards a module's parameters once, so wrapping the block and then a module in
    it would hand the inner one parameters that are sharded over dp already. Blocks that share
    parameters (Zamba's hybrid layers each hold the one shared transformer block) are one FSDP
    group, ``fully_shard([a, b])``: FSDP2 refuses a parameter that two groups manage.
    """
    blocks: list[nn.Module] = []
    inside_units: set[int] = set()
    for module in model.modules():  # parents before their children
        if isinstance(module, nn.ModuleList) and id(module) not in inside_units:
            for child in module:
                if id(child) not in inside_units:
                    blocks.append(child)
                    inside_units.update(id(inner) for inner in child.modules())
    return [*_group_sharing_parameters(blocks), model]


def _group_sharing_parameters(blocks: list[nn.Module]) -> list[nn.Module | list[nn.Module]]:
    """``blocks`` in order, those that share a parameter (directly or through another) as one list."""
    group_of: list[int] = list(range(len(blocks)))

    def root(index: int) -> int:
        while group_of[index] != index:
            index = group_of[index]
        return index

    owner: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for param in block.parameters():
            first = owner.setdefault(id(param), index)
            group_of[root(index)] = root(first)
    members: dict[int, list[nn.Module]] = {}
    for index, block in enumerate(blocks):
        members.setdefault(root(index), []).append(block)
    units: list[nn.Module | list[nn.Module]] = []
    for index, block in enumerate(blocks):
        group = members[root(index)]
        if len(group) == 1:
            units.append(block)
        elif group[0] is block:
            units.append(group)
    return units


def _reshards_after_forward(
    units: list[nn.Module | list[nn.Module]], unit: nn.Module | list[nn.Module]
) -> bool | None:
    """``fully_shard``'s ``reshard_after_forward`` for ``unit`` (of ``_fully_shard_units``).

    The last block's backward comes first, right after the forward: resharding it would only
    gather it again, so it stays gathered (torchtitan's choice). The root (the last unit) gets
    FSDP2's default, ``None``, under which the root keeps its parameters gathered too.
    """
    if unit is units[-1]:
        return None
    return unit is not units[-2]


def _parameters_mesh_object(model: nn.Module, device_mesh: DeviceMesh) -> DeviceMesh:
    """The one mesh object the model's DTensor parameters carry, checked to equal ``device_mesh``.

    FSDP2 compares the parameters' mesh with the mesh it is given by identity. In a long-lived
    process DTensor's sharding cache can hand out an equal mesh object of an earlier model
    (same shape, dim names and groups), so the parameters' own object is the one to pass.
    """
    meshes: dict[int, DeviceMesh] = {}
    for fqn, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise DataParallelMeshError(
                f"parameter {fqn!r} is a plain tensor while others are DTensors; zero_stage=3 on a "
                "tensor-parallel model needs every parameter on the mesh (parallelize the whole model)"
            )
        if param.device_mesh != device_mesh:
            raise DataParallelMeshError(
                f"parameter {fqn!r} lives on {param.device_mesh}, not on the data-parallel mesh "
                f"{device_mesh}; parallelize the model on the same mesh you give to data_parallel"
            )
        meshes[id(param.device_mesh)] = param.device_mesh
    if len(meshes) > 1:
        raise DataParallelMeshError(
            f"the parameters carry {len(meshes)} distinct (equal) mesh objects and FSDP2 takes one; "
            "build every parameter's DTensor on the same DeviceMesh object"
        )
    return next(iter(meshes.values()))


def _mixed_precision_policy(model: nn.Module, compute_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    if compute_dtype is None:
        return MixedPrecisionPolicy()
    for fqn, param in model.named_parameters():
        if param.dtype != torch.float32:
            raise DataParallelConfigError(
                f"compute_dtype={compute_dtype} keeps the parameters as fp32 master weights, but {fqn!r} is "
                f"{param.dtype}; build the model in float32 (do not cast it) and pass compute_dtype"
            )
    # Gradients are reduced and kept in fp32, like the fp32 buckets of stages 0-2.
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def _use_rank_ordered_reduce_scatter(unit: FSDPModule | list[FSDPModule]) -> None:
    # A group's modules share one FSDP state: setting the hook on its first sets it for all.
    first = unit[0] if isinstance(unit, list) else unit
    # FSDP2 duck-types the hook (allocate() and the call); torch annotates its private base class.
    first.set_custom_reduce_scatter(RankOrderedReduceScatter())  # type: ignore[arg-type]


def _batch_sharded_units(model: nn.Module, dims: tuple[str, ...]) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """The modules whose own parameters are sharded over some of the data-parallel ``dims`` (experts
    over ep), each with the dims it is replicated on: FSDP2 shards those over the rest only."""
    units = []
    for module in model.modules():
        # mypy cannot intersect Parameter with DTensor; these are the module's DTensor parameters.
        own = [cast(DTensor, param) for param in module._parameters.values() if isinstance(param, DTensor)]
        if not own:
            continue
        names = mesh_dim_names(own[0].device_mesh)
        kinds = {
            tuple(dim for dim in dims if isinstance(param.placements[names.index(dim)], Replicate))
            for param in own
        }
        replicated = next(iter(kinds))
        if len(kinds) == 1 and replicated == dims:
            continue
        if len(kinds) > 1 or not replicated:
            raise DataParallelMeshError(
                f"{type(module).__name__} mixes parameters sharded and replicated over {dims}, or shards "
                f"over all of them; zero_stage=3 over {dims} shards a module's parameters over the dims "
                "they are replicated on: give its parameters one layout"
            )
        units.append((module, replicated))
    return units


def _apply_zero3_over_dims(
    model: nn.Module, device_mesh: DeviceMesh, dims: tuple[str, ...], deterministic: bool, mp_policy: Any
) -> None:
    """ZeRO-3 over several data-parallel dims (dp x ep): modules with parameters sharded over some of
    them (experts over ep) are FSDP units over the others, their gradients divided by every batch
    rank all the same; the rest are units over all of ``dims``."""
    mesh_dims_class = torch.distributed.fsdp.DataParallelMeshDims
    spmd_mesh = _parameters_mesh_object(model, device_mesh)
    divisor = mesh_dims_group(device_mesh, dims)[1]
    special = _batch_sharded_units(model, dims)
    units = _fully_shard_units(model)
    for unit, replicated in special:
        shard = replicated[0] if len(replicated) == 1 else replicated
        sharded_unit = fully_shard(
            unit,
            mesh=spmd_mesh,
            dp_mesh_dims=mesh_dims_class(shard=shard),
            mp_policy=mp_policy,
            reshard_after_forward=_reshards_after_forward(units, unit),
        )
        # Divided by every batch rank, not by the dp ranks it is reduced over; a sum then a division
        # (gloo has no pre-multiplied sum, which a custom factor would otherwise use).
        sharded_unit.set_gradient_divide_factor(float(divisor))
        sharded_unit.set_force_sum_reduction_for_comms(True)
        if deterministic:
            _use_rank_ordered_reduce_scatter(sharded_unit)
    for block_unit in units:
        if any(block_unit is done for done, _ in special):
            continue
        sharded_block = fully_shard(
            block_unit,
            mesh=spmd_mesh,
            dp_mesh_dims=mesh_dims_class(shard=dims),
            mp_policy=mp_policy,
            reshard_after_forward=_reshards_after_forward(units, block_unit),
        )
        if deterministic:
            _use_rank_ordered_reduce_scatter(sharded_block)
    gather_on_reentry(model)
    _compat.fsdp_forward_hooks_outside_implicit_replication(model)


def _apply_zero3(
    model: nn.Module,
    device_mesh: DeviceMesh,
    mesh_dim: str | tuple[str, ...],
    deterministic: bool,
    compute_dtype: torch.dtype | None,
) -> FullyShardedState:
    on_mesh = any(isinstance(param, DTensor) for param in model.parameters())
    dims = dp_mesh_dims(device_mesh, mesh_dim)
    _compat.unmaterialized_fsdp_post_backward(model)
    if len(dims) > 1:
        if not on_mesh or getattr(torch.distributed.fsdp, "DataParallelMeshDims", None) is None:
            raise DataParallelConfigError(
                f"zero_stage=3 over several mesh dims {dims} needs every parameter a DTensor on the mesh "
                "(parallelize_module(model, mesh, {'parameter': {}}) makes them Replicate) and torch >= 2.13"
            )
        _apply_zero3_over_dims(
            model, device_mesh, dims, deterministic, _mixed_precision_policy(model, compute_dtype)
        )
        state = FullyShardedState(model, device_mesh, dims, deterministic, compute_dtype)
        setattr(model, DATA_PARALLEL_ATTRIBUTE, state)
        for param in model.parameters():
            setattr(param, DATA_PARALLEL_ATTRIBUTE, state)
        return state
    # Public since torch 2.13; torch 2.11 (which veScale supports too) has no FSDP2 entry point
    # for parameters that already live on the whole dp x tp mesh.
    mesh_dims_class = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
    if on_mesh and mesh_dims_class is None:
        raise DataParallelConfigError(
            "zero_stage=3 on a model whose parameters are DTensors already (tensor parallel) needs "
            "torch.distributed.fsdp.DataParallelMeshDims, new in torch 2.13; this is torch "
            f"{torch.__version__}. Upgrade torch, or use zero_stage<=2 with tensor parallelism"
        )
    spmd_mesh = _parameters_mesh_object(model, device_mesh) if on_mesh else device_mesh
    mp_policy = _mixed_precision_policy(model, compute_dtype)
    units = _fully_shard_units(model)
    for unit in units:
        reshard = _reshards_after_forward(units, unit)
        if on_mesh and mesh_dims_class is not None:  # not None on a mesh: checked above
            sharded_unit = fully_shard(
                unit,
                mesh=spmd_mesh,
                dp_mesh_dims=mesh_dims_class(shard=mesh_dim),
                mp_policy=mp_policy,
                reshard_after_forward=reshard,
            )
        else:
            sharded_unit = fully_shard(
                unit, mesh=device_mesh[mesh_dim], mp_policy=mp_policy, reshard_after_forward=reshard
            )
        if deterministic:
            _use_rank_ordered_reduce_scatter(sharded_unit)
    gather_on_reentry(model)
    _compat.fsdp_forward_hooks_outside_implicit_replication(model)
    state = FullyShardedState(model, device_mesh, mesh_dim, deterministic, compute_dtype)
    setattr(model, DATA_PARALLEL_ATTRIBUTE, state)
    for param in model.parameters():
        setattr(param, DATA_PARALLEL_ATTRIBUTE, state)
    return state


def data_parallel(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    zero_stage: int = 0,
    mesh_dim: str | tuple[str, ...] = "dp",
    compute_dtype: torch.dtype | None = None,
    **ddp_options: Any,
) -> nn.Module:
    """Make ``model`` data parallel over ``device_mesh[mesh_dim]`` at ``zero_stage``, in place; return it.

    ``mesh_dim=("dp", "ep")`` is data parallel over dp x ep (expert parallelism): parameters
    sharded over ep (experts) are reduced, and under ZeRO sharded, over dp only.

    ``ddp_options`` go to :class:`~vescale.doptim.DDP` (stages 0-2): ``bucket_size_mb``,
    ``overlap``, ``grad_dtype``, ``deterministic``, ``find_unused_parameters``; stage 3 takes
    ``deterministic`` only. ``compute_dtype`` (stage 3) runs forward and backward in that dtype
    over fp32 master weights; under stages 0-2 cast the model instead (``model.to(torch.bfloat16)``:
    ``DistributedOptimizer`` keeps fp32 masters of it).

    Example::

        model = data_parallel(model, init_mesh(dp=2, tp=2), zero_stage=1, deterministic=True)
        optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters()))
    """
    if zero_stage not in ZERO_STAGES:
        raise DataParallelConfigError(f"zero_stage must be one of {ZERO_STAGES}, not {zero_stage!r}")
    if data_parallel_of(model) is not None:
        raise DataParallelConfigError(
            "the model is data-parallel already; apply data_parallel once per model"
        )
    dp_mesh_dims(device_mesh, mesh_dim)
    if zero_stage < 3 and compute_dtype is not None:
        raise DataParallelConfigError(
            f"compute_dtype is for zero_stage=3 (FSDP2's mixed precision), not {zero_stage}; under stages "
            "0-2 cast the model (model.to(torch.bfloat16)) and DistributedOptimizer keeps fp32 master weights"
        )
    if zero_stage < 3:
        DDP(model, device_mesh, mesh_dim=mesh_dim, zero_stage=zero_stage, **ddp_options)
        return model
    unsupported = sorted(set(ddp_options) - {"deterministic"})
    if unsupported:
        raise DataParallelConfigError(
            f"zero_stage=3 runs on FSDP2, which has no gradient buckets: it takes none of {unsupported}; "
            "drop them (deterministic=True is the only option it takes) or use zero_stage<=2"
        )
    _apply_zero3(model, device_mesh, mesh_dim, bool(ddp_options.get("deterministic", False)), compute_dtype)
    return model
