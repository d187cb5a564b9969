"""``parallelize_experts``: shard an unmodified MoE model's experts over the ``ep`` mesh dim.

Each MoE block found by :func:`~vescale.dmodule.experts.detect.find_moe_blocks` keeps its
module classes, FQNs and router; on its experts module instance:

* every expert parameter (3-D weights, 2-D biases) becomes a DTensor ``Shard(0)`` on
  ``ep_dim`` and ``Replicate`` on every other mesh dim (or, split inside each expert over tp by a
  tensor-parallel plan first, kept so: expert tensor parallelism, :mod:`.tensor_parallel`): each
  rank holds E/ep whole experts (or their tp slices),
  taken from the full parameter it already has (no communication, bitwise the same slice), or
  on a deferred model (``deferred_init``) materialised as that slice only, bitwise equal to the
  same slice of single-device construction (the rest of the model stays deferred);
* the router computes its logits, scores and top-k in float32 (:mod:`.router_precision`);
* ``forward`` (an instance attribute; the ``transformers`` class is untouched) dispatches the
  tokens to the experts' owners and combines the outputs (:mod:`.dispatch`), with the
  capacity factor given, and keeps the last count of dropped pairs in ``dropped_pairs``; under
  ``torch.compile`` it runs eagerly (``torch.compiler.disable``: its split sizes are data), the
  rest of the model compiled around it; recomputed (activation checkpointing), it dispatches
  again in backward, with the same routing.

Everything else stays as it was: under EP the batch is split over every batch dim (dp and
ep), and the non-expert parameters are data-parallel over all of them (see
:mod:`.gradients`). The model's load-balancing loss becomes that of the global batch
(:func:`~vescale.dmodule.experts.aux_loss.attach_global_aux_loss` over the batch dims).

Example::

    mesh = init_mesh(dp=2, ep=2)
    parallelize_experts(model, mesh)                 # experts Shard(0) over ep, Replicate over dp
    loss = model(input_ids=my_share, labels=my_share).loss
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.dmodule.experts.aux_loss import attach_global_aux_loss
from vescale.dmodule.experts.detect import MoEBlock, find_moe_blocks
from vescale.dmodule.experts.dispatch import dispatch_and_combine
from vescale.dmodule.experts.errors import ExpertParallelError
from vescale.dmodule.experts.local_experts import LocalExperts
from vescale.dmodule.experts.router_precision import route_in_float32
from vescale.dmodule.experts.tensor_parallel import TensorParallelExperts, expert_split_dims
from vescale.dtensor.deferred import is_deferred, materialize_tensor

__all__ = [
    "BATCH_DIM_NAMES",
    "EXPERT_PARALLEL_ATTRIBUTE",
    "ExpertParallelState",
    "batch_dims_of",
    "dropped_pairs",
    "expert_parallel_state",
    "is_expert_parameter",
    "parallelize_experts",
]

logger = logging.getLogger("vescale.dmodule")

# The experts module carries its ExpertParallelState, and each expert parameter the ep dim name.
EXPERT_PARALLEL_ATTRIBUTE = "_vescale_expert_parallel"
# Mesh dims that split the batch by default (with the ep dim itself).
BATCH_DIM_NAMES = ("dp", "dp_replicate", "dp_shard")


@dataclass
class ExpertParallelState:
    """What an expert-parallel experts module needs at run time (kept on the module)."""

    fqn: str
    mesh: DeviceMesh
    ep_dim: str
    num_experts: int
    capacity_factor: float | None
    local_experts: LocalExperts
    dropped_pairs: int = 0
    block: MoEBlock | None = field(default=None, repr=False)
    # The mesh dim the experts are also split over inside each expert (expert tensor parallelism).
    split_dim: str | None = None

    @property
    def group(self) -> Any:
        return self.mesh.get_group(self.ep_dim)


def expert_parallel_state(module: nn.Module) -> ExpertParallelState | None:
    """The :class:`ExpertParallelState` of an experts module made expert-parallel, else ``None``.

    Example::

        expert_parallel_state(model.model.layers[0].mlp.experts).dropped_pairs
    """
    return getattr(module, EXPERT_PARALLEL_ATTRIBUTE, None)


def dropped_pairs(model: nn.Module) -> dict[str, int]:
    """``{experts FQN: (token, k) pairs this rank dropped in its last forward}`` (0 when dropless).

    Example::

        parallelize_experts(model, mesh, capacity_factor=1.25)
        model(input_ids=ids); print(sum(dropped_pairs(model).values()))
    """
    return {
        state.fqn: state.dropped_pairs
        for state in (expert_parallel_state(module) for module in model.modules())
        if state is not None
    }


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter sharded over an ep dim by :func:`parallelize_experts`.

    Example::

        [name for name, p in model.named_parameters() if is_expert_parameter(p)]
    """
    return getattr(param, EXPERT_PARALLEL_ATTRIBUTE, None) is not None


def batch_dims_of(mesh: DeviceMesh, ep_dim: str = "ep") -> tuple[str, ...]:
    """The mesh dims the global batch is split over: the data-parallel dims and ``ep_dim``.

    Example::

        batch_dims_of(init_mesh(dp=2, ep=2, tp=1))   # ('dp', 'ep')
    """
    return tuple(dim for dim in mesh.mesh_dim_names or () if dim in (*BATCH_DIM_NAMES, ep_dim))


# Under torch.compile the dispatch runs eagerly: its split sizes are data (counts exchanged between
# ranks, then ``tolist``), which dynamo cannot trace; an eager island breaks the graph once here
# instead of at each data-dependent op, collective and comm scope inside.
@torch.compiler.disable  # type: ignore[untyped-decorator]  # torch leaves it unannotated
def _expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    state: ExpertParallelState = getattr(self, EXPERT_PARALLEL_ATTRIBUTE)
    # Under tensor parallelism (parallelize_module) the inputs are DTensors, replicated over tp:
    # every tp rank dispatches the same tokens over its own ep group.
    dtensor_input = hidden_states if isinstance(hidden_states, DTensor) else None
    hidden_states, top_k_index, top_k_weights = (
        tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for tensor in (hidden_states, top_k_index, top_k_weights)
    )
    compute: Any = state.local_experts
    if state.split_dim is not None:
        compute = TensorParallelExperts(compute, state.mesh.get_group(state.split_dim), state.fqn)
    output, state.dropped_pairs = dispatch_and_combine(
        hidden_states,
        top_k_index,
        top_k_weights,
        compute,
        num_experts=state.num_experts,
        group=state.group,
        capacity_factor=state.capacity_factor,
        scope=state.fqn,
    )
    if dtensor_input is not None:
        mesh, placements = dtensor_input.device_mesh, dtensor_input.placements
        output = DTensor.from_local(output, mesh, placements, run_check=False)
    return output


def _shard_parameter(
    param: nn.Parameter, mesh: DeviceMesh, ep_index: int, ep_dim: str, fqn: str
) -> nn.Parameter:
    # Replicate over every other dim, or the split inside each expert a tensor-parallel plan gave it.
    kept = list(param.placements) if isinstance(param, DTensor) else [Replicate()] * mesh.ndim
    placements = [Shard(0) if index == ep_index else kept[index] for index in range(mesh.ndim)]
    if is_deferred(param):
        # A deferred model (vescale.deferred_init): this rank materialises its experts only, with the
        # values (and random draws) of single-device construction.
        sharded = materialize_tensor(param, mesh, placements, fqn=fqn)
    else:
        ep_size, ep_rank = mesh.size(ep_index), mesh.get_local_rank(ep_dim)
        per_rank = param.shape[0] // ep_size
        # A DTensor's local tensor holds every expert (whole over ep), split inside each over tp.
        full = param.to_local() if isinstance(param, DTensor) else param
        local = full.detach()[ep_rank * per_rank : (ep_rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    new_param = nn.Parameter(sharded, requires_grad=param.requires_grad)
    setattr(new_param, EXPERT_PARALLEL_ATTRIBUTE, ep_dim)
    return new_param


def _check_block(
    block: MoEBlock, experts: nn.Module, mesh: DeviceMesh, ep_size: int, ep_dim: str, has_bias: bool
) -> str | None:
    """Raise unless the block's experts split over ``ep_dim``; the mesh dim they are split over
    inside each expert (a tensor-parallel plan's column/row split), if any."""
    if block.num_experts % ep_size:
        raise ExpertParallelError(
            f"{block.experts_fqn}: {block.num_experts} experts do not split over {ep_dim}={ep_size} "
            f"(each rank must hold whole experts); use an {ep_dim} size that divides {block.num_experts}"
        )
    params = {name: experts._parameters[name] for name in block.expert_parameters}
    present = {name: param for name, param in params.items() if param is not None}
    split = expert_split_dims(block.experts_fqn, present, mesh, ep_dim, has_bias)
    return split[0] if split else None


def parallelize_experts(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    ep_dim: str = "ep",
    capacity_factor: float | None = None,
    batch_dims: Sequence[str] | None = None,
    use_grouped_mm: bool | None = None,
    float32_router: bool = True,
) -> nn.Module:
    """Shard ``model``'s experts over ``mesh[ep_dim]`` and dispatch tokens to them (in place).

    ``capacity_factor`` (default dropless) caps each source rank's pairs per expert at
    ``ceil(factor · tokens · k / E)``; ``batch_dims`` (default :func:`batch_dims_of`) are the
    dims the global batch is split over, for the global load-balancing loss;
    ``use_grouped_mm=False`` forces one matmul per local expert; ``float32_router`` computes the
    routers' logits, scores and top-k in float32 whatever the model's dtype (:mod:`.router_precision`).

    Example::

        parallelize_experts(model, init_mesh(ep=4))
        model(input_ids=ids, labels=ids).loss.backward()   # then average grads (see .gradients)
    """
    names = mesh.mesh_dim_names or ()
    if ep_dim not in names:
        raise ExpertParallelError(
            f"the mesh has no {ep_dim!r} dim (its dims: {names}); build it with one, e.g. "
            f"init_mesh(dp=2, {ep_dim}=2), or pass ep_dim= one of {names}"
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise ExpertParallelError(
            f"capacity_factor must be positive or None (dropless), not {capacity_factor!r}"
        )
    ep_index = names.index(ep_dim)
    ep_size = mesh.size(ep_index)
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ExpertParallelError(
            f"{type(model).__name__} has no MoE block (a module with a fused 'experts' child holding 3-D "
            "'gate_up_proj'/'up_proj' and 'down_proj'); expert parallelism has nothing to shard"
        )
    for block in blocks:
        experts = model.get_submodule(block.experts_fqn)
        local_experts = LocalExperts(experts, use_grouped_mm=use_grouped_mm)
        split_dim = _check_block(block, experts, mesh, ep_size, ep_dim, local_experts.has_bias)
        for name in block.expert_parameters:
            parameter = experts._parameters[name]
            if parameter is None:  # find_moe_blocks lists the parameters the module holds
                raise ExpertParallelError(
                    f"{block.experts_fqn}.{name} is None; expert parallelism shards the experts' "
                    "parameters and this one is missing: build the model before parallelising it"
                )
            experts._parameters[name] = _shard_parameter(
                parameter, mesh, ep_index, ep_dim, f"{block.experts_fqn}.{name}"
            )
        state = ExpertParallelState(
            block.experts_fqn,
            mesh,
            ep_dim,
            block.num_experts,
            capacity_factor,
            local_experts,
            block=block,
            split_dim=split_dim,
        )
        setattr(experts, EXPERT_PARALLEL_ATTRIBUTE, state)
        experts.forward = types.MethodType(_expert_parallel_forward, experts)
        if float32_router and block.router_fqn is not None:
            route_in_float32(model.get_submodule(block.router_fqn))
    if batch_dims is None:
        batch_dims = batch_dims_of(mesh, ep_dim)
    attach_global_aux_loss(model, mesh, batch_dims=batch_dims)
    logger.info(
        "expert parallelism over %s=%d: %d MoE blocks, %d experts each, %d per rank",
        ep_dim,
        ep_size,
        len(blocks),
        blocks[0].num_experts,
        blocks[0].num_experts // ep_size,
    )
    return model
