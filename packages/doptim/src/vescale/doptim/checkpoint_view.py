"""A DistributedOptimizer seen as a plain optimizer over the model's parameters, for checkpoints.

Stages 0-2 step per-rank ranges of flat buckets (the masters), which no parameter FQN names
and no DTensor layout describes, so a checkpoint library that keys optimizer state by the
model's parameters (``vescale.dcheckpoint``, like ``torch.distributed.checkpoint``) cannot
read them as they are. :class:`OptimizerCheckpointView` is a ``torch.optim.Optimizer`` whose
``param_groups`` hold the model's parameters and whose ``state`` maps each parameter to its
state as a DTensor on the model's mesh: laid out like the parameter on every other mesh dim
and ``Shard(dim)`` over dp on a tensor dim no other mesh dim shards (``Replicate`` over dp when
every dim is taken), so each rank holds 1/dp of the state and the checkpoint reshards it into
any dp size and ZeRO stage. Building the view gathers the state one bucket at a time
(collective; one bucket of scratch memory). Separate fp32 master weights (a bf16 model under
stages 0-2) are in the state as ``"master_weight"``, dp-sharded like the rest.

Writing into the view loads: ``view.state[param] = {...}`` (tensors laid out like the parameter,
or global) stores this rank's range into the optimizer's state and its ``"master_weight"`` into
the weights (:func:`~vescale.doptim.state_dict.install_param_state`), and ``group.update(...)``
on a view group updates the optimizer's group. Under ZeRO-3 the optimizer keys its state by
the model's (FSDP2) parameters already, and the view holds that optimizer's own groups and state.

Example::

    dcheckpoint.save("ckpt/step-10", {"model": model, "optimizer": optimizer.checkpoint_view()})
    dcheckpoint.load("ckpt", {"model": model, "optimizer": optimizer.checkpoint_view()})
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from vescale.doptim.ddp import DDP
from vescale.doptim.errors import DataParallelMeshError
from vescale.doptim.sharded_optimizer import ShardedOptimizer
from vescale.doptim.state_dict import install_param_state, local_states
from vescale.doptim.zero import ParamShard

__all__ = ["OptimizerCheckpointView", "dp_shard_placements"]


def dp_shard_placements(param: torch.Tensor, ddp: DDP) -> tuple[Any, ...]:
    """The parameter's placements with the dp mesh dim sharding the first tensor dim no other mesh dim
    shards (``Replicate`` over dp when there is none).

    Example::

        dp_shard_placements(tp_column_weight, ddp)   # (Shard(1), Shard(0)) on a (dp, tp) mesh
    """
    dp_index = _dp_mesh_index(ddp)
    if isinstance(param, DTensor):
        placements = list(param.placements)
    else:
        placements = [Replicate()] * ddp.device_mesh.ndim
    taken = {placement.dim for placement in placements if hasattr(placement, "dim")}
    free = [dim for dim in range(param.dim()) if dim not in taken]
    placements[dp_index] = Shard(free[0]) if free else Replicate()
    return tuple(placements)


def _dp_mesh_index(ddp: DDP) -> int:
    names = ddp.device_mesh.mesh_dim_names
    if names is None:  # DDP names its mesh dim, so its mesh has names
        raise DataParallelMeshError(
            f"the data-parallel mesh has no dim names, so its dim {ddp.mesh_dim!r} cannot be found; "
            "build the mesh with init_mesh(dp=...)"
        )
    # Over dp x ep the state is sharded over dp and kept whole over ep (each ep rank's experts are
    # its own; the rest is the same on every ep rank and written once).
    return names.index(ddp.mesh_dims[0])


def _dp_sharded(shard: ParamShard, ddp: DDP, local: torch.Tensor) -> DTensor:
    """This rank's dp piece of ``local`` (the whole state of the parameter's local tensor), as a DTensor."""
    param = shard.param
    placements = dp_shard_placements(param, ddp)
    dp_index = _dp_mesh_index(ddp)
    piece = local
    dp_placement = placements[dp_index]
    if isinstance(dp_placement, Shard):
        # torch.chunk's split, as DTensor's Shard: ceil-sized pieces, the last ones short or empty.
        dp_size = ddp.device_mesh.size(dp_index)
        chunks = list(local.chunk(dp_size, dim=dp_placement.dim))
        chunks += [local.narrow(dp_placement.dim, 0, 0)] * (dp_size - len(chunks))
        piece = chunks[ddp.device_mesh.get_local_rank(ddp.mesh_dims[0])]
    global_shape = param.shape
    return DTensor.from_local(
        piece.clone(),
        ddp.device_mesh,
        placements,
        run_check=False,
        shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(),
    )


class _GroupView(dict[str, Any]):
    """A parameter group over the model's parameters whose updates reach the optimizer's group."""

    def __init__(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        super().__init__({**group, "params": params})
        self.group = group

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key != "params":
            self.group[key] = value

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


class _StateView(dict[torch.Tensor, dict[str, Any]]):
    """``{model parameter: state}``; assigning a parameter's state stores this rank's part of it (and
    its ``MASTER_WEIGHT`` into the weights)."""

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.fqn_of = {id(param): fqn for fqn, param in optimizer.owner.module.named_parameters()}

    def __setitem__(self, param: torch.Tensor, param_state: dict[str, Any]) -> None:
        super().__setitem__(param, param_state)
        shard = self.optimizer.shards.get(id(param))
        master = param if shard is None else shard.master
        install_param_state(self.optimizer, self.fqn_of[id(param)], master, param_state)


class OptimizerCheckpointView(Optimizer):
    """``optimizer`` keyed by the model's parameters, its state dp-sharded DTensors (see the module).

    Build it on every rank (collective), right before saving or loading; it is a snapshot of
    the state when built, and loading into it writes through to ``optimizer``.

    Example::

        view = OptimizerCheckpointView(optimizer)
        view.state[model.fc.weight]["exp_avg"]     # a DTensor of fc.weight's global shape
    """

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        if not isinstance(optimizer.owner, DDP):
            # ZeRO-3 keys its state by the model's parameters already; writes still go through
            # install_param_state, which takes a saved MASTER_WEIGHT into the (fp32) parameters.
            self.param_groups = optimizer.param_groups
            # torch types Optimizer.state as a defaultdict; what reads the view needs a mapping.
            self.state = _StateView(optimizer)  # type: ignore[assignment]
            for param, param_state in optimizer.state.items():
                dict.__setitem__(self.state, param, param_state)
            return
        ddp: DDP = optimizer.owner
        param_of = {id(shard.master): shard.param for shard in optimizer.shards.values()}
        self.param_groups = [
            _GroupView(group, [param_of[id(master)] for master in group["params"]])
            for group in optimizer.param_groups
        ]
        state = _StateView(optimizer)
        snapshot: dict[torch.Tensor, dict[str, Any]] = {}
        for shard, name, value, elementwise in local_states(optimizer):
            if elementwise:
                value = _dp_sharded(shard, ddp, value)
            elif torch.is_tensor(value):
                value = value.clone()
            snapshot.setdefault(shard.param, {})[name] = value
        for param, param_state in snapshot.items():
            dict.__setitem__(state, param, param_state)
        self.state = state  # type: ignore[assignment]  # a mapping, as above

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Not a training optimizer: step the DistributedOptimizer it views."""
        raise TypeError("an OptimizerCheckpointView is for saving and loading; step the DistributedOptimizer")

    def __repr__(self) -> str:
        return f"OptimizerCheckpointView({self.optimizer!r})"
