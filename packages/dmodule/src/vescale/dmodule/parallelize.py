"""``parallelize_module``: turn an unmodified ``nn.Module`` into a DModule, in place.

Steps, all decided before anything changes so that a bad plan leaves the module untouched:

1. the plan is parsed and resolved against the module (every pattern must match; every
   placement must be possible for its tensor);
2. every parameter becomes a DTensor on the whole mesh: the plan's placements on the
   plan's mesh dim, Replicate on every other dim (and for parameters the plan does not
   name). Tied parameters stay one parameter. Values come from rank 0's module, or, for a
   module built with ``deferred_init``, from replaying its initialisation: each rank then
   allocates only its shards;
3. forward hooks put the inputs and outputs the plan names into their placements (one
   conversion per input tensor and target per forward, shared by sibling modules);
4. plain tensors created inside the module's forward count as Replicate, also where
   activation checkpointing recomputes a block during backward
   (:func:`vescale.dtensor.implicit_replication.implicit_replication_scope`);
5. gradients that arrive Partial (Replicate parameters next to sharded activations) are
   reduced at the end of backward (:mod:`vescale.dtensor.grad_sync`);
6. an exception in a forward names the innermost module and its input placements;
7. a submodule whose forward is verified to compute the same on local tensors runs on them
   (:mod:`vescale.dmodule.local_execution`; ``local_execution=False`` turns it off);
8. random ops on DTensors (dropout) give single-device values from the generator state every
   rank holds (:func:`vescale.dtensor.random.use_single_device_random`): seed every rank alike,
   ``torch.manual_seed(s)`` or ``vescale.dtensor.random.manual_seed(s)``.

Example::

    mesh = init_mesh(tp=2)
    model = parallelize_module(model, mesh, {"parameter": {r"fc1\\.weight": "S(0)", r"fc2\\.weight": "S(1)"}})
    model(x).sum().backward()
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.hooks import RemovableHandle

import vescale.dtensor.ops  # noqa: F401  (registers the sharding strategies a model forward needs)
from vescale.dmodule._forward_hooks import InputConversionCache, register_forward_placement_hooks
from vescale.dmodule.debug import name_failing_modules
from vescale.dmodule.errors import DModuleError
from vescale.dmodule.local_execution import install_local_execution, run_pending_trials
from vescale.dmodule.sharding_plan import ResolvedShardingPlan, ShardingPlan
from vescale.dtensor.deferred import is_deferred, materialize_module
from vescale.dtensor.grad_sync import GradSync, attach_grad_sync
from vescale.dtensor.implicit_replication import ImplicitReplicationHandle, implicit_replication_scope
from vescale.dtensor.placements import distribute_tensor
from vescale.dtensor.random import use_single_device_random

__all__ = ["DMODULE_ATTRIBUTE", "DModuleState", "is_dmodule", "parallelize_module"]

DMODULE_ATTRIBUTE = "_vescale_dmodule"


@dataclass
class DModuleState:
    """What ``parallelize_module`` did to a module: its mesh, plan and the hooks it installed."""

    mesh: DeviceMesh
    mesh_dim: int
    plan: ShardingPlan
    resolved: ResolvedShardingPlan
    grad_sync: GradSync
    implicit_replication: ImplicitReplicationHandle
    hook_handles: list[RemovableHandle] = field(default_factory=list)
    local_execution: list[nn.Module] = field(default_factory=list)
    # Input conversions shared by sibling consumers within one forward (see InputConversionCache).
    conversions: InputConversionCache = field(default_factory=InputConversionCache)


def is_dmodule(module: nn.Module) -> bool:
    """Whether ``parallelize_module`` has been applied to ``module``."""
    return getattr(module, DMODULE_ATTRIBUTE, None) is not None


def _mesh_dim_index(mesh: DeviceMesh, mesh_dim: str | int) -> int:
    names = mesh.mesh_dim_names
    if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool):
        if 0 <= mesh_dim < mesh.ndim:
            return mesh_dim
        raise DModuleError(
            f"mesh_dim={mesh_dim} does not exist in a {mesh.ndim}-dim mesh; use 0..{mesh.ndim - 1}"
        )
    if names and mesh_dim in names:
        return names.index(mesh_dim)
    if not names and mesh.ndim == 1:
        return 0
    raise DModuleError(
        f"mesh_dim={mesh_dim!r} is not a dimension of the mesh (its dims: {names}); pass one of them, "
        "e.g. parallelize_module(model, mesh, plan, mesh_dim='tp')"
    )


def _check_parallelizable(module: nn.Module) -> None:
    for fqn, submodule in module.named_modules():
        if is_dmodule(submodule):
            where = "the module" if not fqn else f"its submodule {fqn!r}"
            raise DModuleError(
                f"{where} is parallelized already; parallelize_module applies once per module tree. Build "
                "the model again (or deferred_init it) and apply one plan that covers it all"
            )
    for fqn, parameter in module.named_parameters():
        if isinstance(parameter, DTensor):
            raise DModuleError(
                f"parameter {fqn!r} is a DTensor already; parallelize_module expects the single-device module"
            )
        if parameter.is_meta:
            raise DModuleError(
                f"parameter {fqn!r} is on the meta device (no values); build the module with "
                "vescale.dmodule.deferred_init instead, so that parallelize_module can materialise it"
            )


def _distributed_parameters(
    module: nn.Module, mesh: DeviceMesh, resolved: ResolvedShardingPlan
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(owner, name, new parameter)`` for every parameter slot; tied slots share one parameter."""
    replicate_everywhere = (Replicate(),) * mesh.ndim
    by_identity: dict[int, nn.Parameter] = {}
    slots = []
    for module_fqn, owner in module.named_modules(remove_duplicate=False):
        for name, parameter in owner._parameters.items():
            if parameter is None:
                continue
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            if id(parameter) not in by_identity:
                sharding = resolved.parameters.get(fqn)
                placements = sharding.placements if sharding is not None else replicate_everywhere
                dtensor = distribute_tensor(parameter.detach(), mesh, placements)
                by_identity[id(parameter)] = nn.Parameter(dtensor, requires_grad=parameter.requires_grad)
            slots.append((owner, name, by_identity[id(parameter)]))
    return slots


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    sharding_plan: Mapping[str, Any] | ShardingPlan,
    *,
    mesh_dim: str | int = "tp",
    local_execution: bool = True,
) -> nn.Module:
    """Apply ``sharding_plan`` to ``module`` on ``device_mesh``'s ``mesh_dim``, in place; return it.

    Example::

        model = parallelize_module(model, init_mesh(dp=2, tp=2), plan)   # plan applies on "tp"
        print(vescale.dmodule.format_placements(model))
    """
    plan = ShardingPlan.from_dict(sharding_plan)
    _check_parallelizable(module)
    mesh_dim_index = _mesh_dim_index(device_mesh, mesh_dim)
    resolved = plan.resolve(module, mesh_shape=tuple(device_mesh.shape), mesh_dim=mesh_dim_index)
    use_single_device_random()
    if any(is_deferred(tensor) for tensor in [*module.parameters(), *module.buffers()]):
        # Each rank allocates only its final shards, with the values eager construction gives.
        replicate_everywhere = (Replicate(),) * device_mesh.ndim
        parameter_fqns = {fqn for fqn, _ in module.named_parameters(remove_duplicate=False)}

        def placements_for(fqn: str) -> tuple[DeviceMesh, tuple[Any, ...]] | None:
            if fqn not in parameter_fqns:
                return None  # buffers stay plain tensors, identical on every rank
            sharding = resolved.parameters.get(fqn)
            return device_mesh, sharding.placements if sharding is not None else replicate_everywhere

        materialize_module(module, placements_for)
    else:
        for owner, name, parameter in _distributed_parameters(module, device_mesh, resolved):
            owner._parameters[name] = parameter

    modules = dict(module.named_modules())
    conversions = InputConversionCache()
    local_modules = install_local_execution(module, device_mesh, mesh_dim_index) if local_execution else []
    hook_handles = [
        # Local execution's trials, noted at the modules' first calls, run before the next forward:
        # the step that noted them has freed its activations by then.
        module.register_forward_pre_hook(lambda *_: run_pending_trials(module, local_modules)),
        module.register_forward_pre_hook(lambda *_: conversions.clear()),
        module.register_forward_hook(lambda *_: conversions.clear(), always_call=True),
    ]
    for fqn in dict.fromkeys([*resolved.inputs, *resolved.outputs]):
        hook_handles += register_forward_placement_hooks(
            modules[fqn],
            device_mesh,
            inputs=resolved.inputs.get(fqn, (None,))[0],
            outputs=resolved.outputs.get(fqn, (None,))[0],
            fqn=fqn,
            cache=conversions,
        )
    hook_handles += name_failing_modules(module)
    state = DModuleState(
        mesh=device_mesh,
        mesh_dim=mesh_dim_index,
        plan=plan,
        resolved=resolved,
        grad_sync=attach_grad_sync(module),
        implicit_replication=implicit_replication_scope(module),
        hook_handles=hook_handles,
        local_execution=local_modules,
        conversions=conversions,
    )
    setattr(module, DMODULE_ATTRIBUTE, state)
    return module
