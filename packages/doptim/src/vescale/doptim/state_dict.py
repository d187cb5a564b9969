"""A DistributedOptimizer's state in single-device terms: per parameter FQN, global shapes.

Saving gathers: each ZeRO chunk over dp (one all-gather per bucket and state name), then
each tensor-parallel shard over the other mesh dims (``DTensor.full_tensor``). Loading takes
every rank's part of the global tensors without communication. A state saved under one dp
size or ZeRO stage therefore loads under any other. Per-parameter scalars (Adam's ``step``)
are kept as they are.

Under mixed precision (stages 0-2 over a bf16 model) the fp32 master weights are state too:
each parameter's entry holds ``"master_weight"`` (fp32, the parameter's global shape) next to
``exp_avg``, so a bf16 run resumes bitwise. Loading it sets the masters (or, where the masters
are the parameters themselves, the parameters); loading a state without it rebuilds separate
masters from the parameters, which must therefore be loaded first.

Example::

    saved = optimizer.state_dict()          # {"state": {"0.weight": {"exp_avg": ...}}, "param_groups": [...]}
    other_optimizer.load_state_dict(saved)  # another dp size or stage
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from vescale.doptim.buckets import local_tensor
from vescale.doptim.ddp import DDP
from vescale.doptim.errors import DataParallelConfigError
from vescale.doptim.reduction import all_gather_flat
from vescale.doptim.sharded_optimizer import ShardedOptimizer
from vescale.doptim.zero import ParamShard
from vescale.dtensor.placements import from_local_like

__all__ = [
    "MASTER_WEIGHT",
    "install_param_state",
    "load_optimizer_state",
    "local_states",
    "master_part",
    "optimizer_state",
]

# The state entry holding a parameter's fp32 master weight when it is not the parameter itself.
MASTER_WEIGHT = "master_weight"


def _is_elementwise(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == master.shape


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _masters_by_fqn(optimizer: ShardedOptimizer) -> dict[str, torch.Tensor]:
    if isinstance(optimizer.owner, DDP):
        return {shard.fqn: shard.master for shard in optimizer.shards.values()}
    return dict(optimizer.owner.module.named_parameters())


def _to_global(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return local.view(param.shape).clone()
    local = local.view(param.to_local().shape)
    return from_local_like(local, param).full_tensor()


def local_states(optimizer: ShardedOptimizer) -> Iterator[tuple[ParamShard, str, Any, bool]]:
    """Every ``(shard, state name, value, elementwise)`` of a stage 0-2 optimizer, bucket by bucket, in
    the same order on every rank (collective under stages 1-2: one all-gather per bucket and name).

    An element-wise state tensor (``elementwise=True``) comes whole: shaped like the parameter's
    local tensor, a view into its bucket's gathered state; other values (Adam's ``step``) as this
    rank holds them. Separate master weights come as the element-wise state ``MASTER_WEIGHT``.

    Example::

        for shard, name, value, elementwise in local_states(optimizer):
            print(shard.fqn, name, elementwise)
    """
    ddp = optimizer.owner
    if not isinstance(ddp, DDP):  # ZeRO-3 keeps its state keyed by the parameters (no buckets)
        raise DataParallelConfigError(
            "local_states reads the bucketed state of ZeRO stages 0-2; a ZeRO-3 optimizer's state is "
            "keyed by the model's parameters already"
        )
    for bucket in ddp.buckets:
        shards = [optimizer.shards[id(slot.param)] for slot in bucket.slots]
        names = sorted({name for shard in shards for name in optimizer.state.get(shard.master, {})})
        if MASTER_WEIGHT in names:
            raise DataParallelConfigError(
                f"the optimizer keeps a state named {MASTER_WEIGHT!r} (for {shards[0].fqn!r}), the name "
                "DistributedOptimizer saves its fp32 master weights under; rename that optimizer state"
            )
        # A bucket holds one parameter dtype, so its masters are all views or all separate copies.
        if not shards[0].master_is_view:
            names.append(MASTER_WEIGHT)
        chunk_start = bucket.chunk_range(bucket.reduction_group.rank)[0]
        for name in names:
            if name == MASTER_WEIGHT:
                values = [shard.master for shard in shards]
            else:
                values = [optimizer.state.get(shard.master, {}).get(name) for shard in shards]
            if not any(
                _is_elementwise(value, shard.master) for value, shard in zip(values, shards, strict=True)
            ):
                for shard, value in zip(shards, values, strict=True):
                    if value is not None:
                        yield shard, name, value, False
                continue
            dtype = next(v.dtype for v, s in zip(values, shards, strict=True) if _is_elementwise(v, s.master))
            # A parameter the optimizer never stepped (no rank used it) has no state to gather or yield.
            stepped = [(shard, v) for shard, v in zip(shards, values, strict=True) if v is not None]
            if ddp.zero_stage == 0:
                flat_state = torch.zeros(bucket.padded_numel, dtype=dtype)
                for shard, value in stepped:
                    slot = shard.bucket_and_slot()[1]
                    flat_state[slot.offset : slot.offset + slot.numel].copy_(value)
            else:
                chunk = torch.zeros(bucket.chunk_numel, dtype=dtype)
                for shard, value in stepped:
                    begin = shard.bucket_and_slot()[1].offset + shard.start - chunk_start
                    chunk[begin : begin + shard.end - shard.start].copy_(value)
                flat_state = torch.empty(bucket.padded_numel, dtype=dtype)
                all_gather_flat(flat_state, chunk, group=bucket.reduction_group.group)
            for shard, _ in stepped:
                slot = shard.bucket_and_slot()[1]
                local = flat_state[slot.offset : slot.offset + slot.numel]
                yield shard, name, local.view(slot.local_shape), True


def _gathered_ddp_state(optimizer: ShardedOptimizer) -> dict[str, dict[str, Any]]:
    state: dict[str, dict[str, Any]] = {}
    for shard, name, value, elementwise in local_states(optimizer):
        if elementwise:
            state.setdefault(shard.fqn, {})[name] = _to_global(shard.param, value)
        else:
            state.setdefault(shard.fqn, {})[name] = value.clone() if torch.is_tensor(value) else value
    return state


def optimizer_state(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``, global tensors.

    Example::

        torch.save(optimizer_state(optimizer), "optimizer.pt")   # identical on every rank
    """
    fqn_of = {id(master): fqn for fqn, master in _masters_by_fqn(optimizer).items()}
    if isinstance(optimizer.owner, DDP):
        state = _gathered_ddp_state(optimizer)
    else:
        state = {
            fqn_of[id(param)]: {
                # Copies, as under stages 0-2: the state dict must not change when the optimizer steps.
                name: value.full_tensor() if isinstance(value, DTensor) else _copy(value)
                for name, value in optimizer.state.get(param, {}).items()
            }
            for group in optimizer.param_groups
            for param in group["params"]
        }
    param_groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [fqn_of[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": param_groups}


def _shard_of(optimizer: ShardedOptimizer, master: torch.Tensor) -> ParamShard:
    return next(shard for shard in optimizer.shards.values() if shard.master is master)


def _local_part(
    optimizer: ShardedOptimizer, fqn: str, master: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    if not isinstance(optimizer.owner, DDP):
        sharded_master = cast(DTensor, master)  # ZeRO-3's masters are its DTensor parameters
        return distribute_tensor(
            value, sharded_master.device_mesh, sharded_master.placements, src_data_rank=None
        )
    return master_part(_shard_of(optimizer, master), fqn, value)


def _param_local(param: torch.Tensor, fqn: str, value: torch.Tensor) -> torch.Tensor:
    """The parameter's local tensor's worth of ``value`` (global, or a DTensor of any layout)."""
    local = value
    if isinstance(value, DTensor):
        if not isinstance(param, DTensor):
            raise DataParallelConfigError(
                f"the state of {fqn!r} is a DTensor but the parameter is a plain tensor; load a state "
                "saved from the same kind of parameter"
            )
        local = value.redistribute(param.device_mesh, param.placements).to_local()
    elif isinstance(param, DTensor):
        local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
    if local.numel() != local_tensor(param).numel():
        raise DataParallelConfigError(
            f"optimizer state of {fqn!r} has shape {tuple(value.shape)}; "
            f"the parameter's is {tuple(param.shape)}"
        )
    return local


def master_part(shard: ParamShard, fqn: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's range (``shard.master``'s elements) of a state tensor shaped like the parameter:
    a global tensor, or a DTensor laid out like the parameter.

    Example::

        optimizer.state[shard.master]["exp_avg"] = master_part(shard, "fc.weight", global_exp_avg)
    """
    local = _param_local(shard.param, fqn, value)
    return local.reshape(-1)[shard.start : shard.end].to(shard.master.dtype).clone()


@torch.no_grad()
def _load_weights(
    optimizer: ShardedOptimizer, fqn: str, master: torch.Tensor, master_weight: torch.Tensor | None
) -> None:
    if not isinstance(optimizer.owner, DDP):
        # ZeRO-3: the fp32 parameter shards are the master weights.
        if master_weight is not None:
            local_tensor(master).copy_(_param_local(master, fqn, master_weight).view_as(local_tensor(master)))
        return
    shard = _shard_of(optimizer, master)
    if shard.master_is_view:
        if master_weight is not None:
            # The whole local tensor, not this rank's range: dp ranks must keep identical parameters.
            param_local = local_tensor(shard.param)
            param_local.copy_(_param_local(shard.param, fqn, master_weight).view_as(param_local))
        return
    if master_weight is None:
        # A state saved without masters (an fp32 run's): the loaded parameters are the weights.
        master_weight = local_tensor(shard.param).detach()
    shard.master.copy_(master_part(shard, fqn, master_weight))


def install_param_state(
    optimizer: ShardedOptimizer, fqn: str, master: torch.Tensor, param_state: dict[str, Any]
) -> None:
    """Store one parameter's saved state (global tensors, or DTensors of the parameter's global shape)
    as this rank's part of the state of ``master``; its ``MASTER_WEIGHT`` sets the weights, and
    without one, separate masters are rebuilt from the parameter (load the model first).

    Example::

        install_param_state(optimizer, "fc.weight", shard.master, {"exp_avg": exp_avg, "step": step})
    """
    _load_weights(optimizer, fqn, master, param_state.get(MASTER_WEIGHT))
    param = master if not isinstance(optimizer.owner, DDP) else _shard_of(optimizer, master).param
    optimizer.state[master] = {
        name: _local_part(optimizer, fqn, master, value)
        if _is_param_shaped(name, value, param)
        else (value.clone() if torch.is_tensor(value) else value)
        for name, value in param_state.items()
        if name != MASTER_WEIGHT
    }


def _is_param_shaped(name: str, value: Any, param: torch.Tensor) -> bool:
    """Whether a saved state value is element-wise (one element per parameter element). A scalar
    parameter's ``exp_avg`` is as 0-dim as Adam's ``step``, which torch's optimizers, like this,
    tell apart by its name."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return False
    return value.dim() >= 1 or name != "step"


def load_optimizer_state(optimizer: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load :func:`optimizer_state`'s output, saved under any dp size and ZeRO stage.

    Example::

        load_optimizer_state(optimizer, torch.load("optimizer.pt"))
    """
    masters = _masters_by_fqn(optimizer)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise DataParallelConfigError(
            f"the state has {len(saved_groups)} parameter groups, "
            f"the optimizer {len(optimizer.param_groups)}; "
            "build the optimizer with the same groups as the one saved"
        )
    fqn_of = {id(master): fqn for fqn, master in masters.items()}
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        fqns = [fqn_of[id(p)] for p in group["params"]]
        if fqns != saved["params"]:
            missing = sorted(set(fqns) ^ set(saved["params"]))
            raise DataParallelConfigError(f"parameter groups differ from the saved ones at {missing[:3]}")
        group.update({key: value for key, value in saved.items() if key != "params"})
    unknown = sorted(set(state_dict["state"]) - set(masters))
    if unknown:
        raise DataParallelConfigError(
            f"the state holds parameters the model does not have: {unknown[:3]}; load it into the model "
            "it was saved from"
        )
    for fqn, master in masters.items():
        if fqn in state_dict["state"]:
            install_param_state(optimizer, fqn, master, state_dict["state"][fqn])
        else:
            _load_weights(optimizer, fqn, master, None)
