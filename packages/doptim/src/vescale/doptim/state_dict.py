"""A DistributedOptimizer's state in single-device terms: per parameter FQN, global shapes.

Saving gathers: each ZeRO chunk over dp (one all-gather per bucket and state name), then
each tensor-parallel shard over the other mesh dims (``DTensor.full_tensor``). Loading takes
every rank's part of the global tensors without communication. A state saved under one dp
size or ZeRO stage therefore loads under any other. Per-parameter scalars (Adam's ``step``)
are kept as they are.

Example::

    saved = optimizer.state_dict()          # {"state": {"0.weight": {"exp_avg": ...}}, "param_groups": [...]}
    other_optimizer.load_state_dict(saved)  # another dp size or stage
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from vescale.doptim.buckets import local_tensor
from vescale.doptim.ddp import DDP
from vescale.doptim.errors import DataParallelConfigError
from vescale.doptim.reduction import all_gather_flat
from vescale.doptim.zero import ParamShard

if TYPE_CHECKING:
    from vescale.doptim.optimizer import DistributedOptimizer

__all__ = ["load_optimizer_state", "local_states", "master_part", "optimizer_state"]


def _is_elementwise(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == master.shape


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _masters_by_fqn(optimizer: DistributedOptimizer) -> dict[str, torch.Tensor]:
    if isinstance(optimizer.owner, DDP):
        return {shard.fqn: shard.master for shard in optimizer.shards.values()}
    return dict(optimizer.owner.module.named_parameters())


def _to_global(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return local.view(param.shape).clone()
    local = local.view(param.to_local().shape)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    ).full_tensor()


def local_states(optimizer: DistributedOptimizer) -> Iterator[tuple[ParamShard, str, Any, bool]]:
    """Every ``(shard, state name, value, elementwise)`` of a stage 0-2 optimizer, bucket by bucket, in
    the same order on every rank (collective under stages 1-2: one all-gather per bucket and name).

    An element-wise state tensor (``elementwise=True``) comes whole: shaped like the parameter's
    local tensor, a view into its bucket's gathered state; other values (Adam's ``step``) as this
    rank holds them.

    Example::

        for shard, name, value, elementwise in local_states(optimizer):
            print(shard.fqn, name, elementwise)
    """
    ddp: DDP = optimizer.owner
    for bucket in ddp.buckets:
        shards = [optimizer.shards[id(slot.param)] for slot in bucket.slots]
        names = sorted({name for shard in shards for name in optimizer.state.get(shard.master, {})})
        chunk_start = bucket.chunk_range(ddp.dp_rank)[0]
        for name in names:
            values = [optimizer.state.get(shard.master, {}).get(name) for shard in shards]
            if not any(
                _is_elementwise(value, shard.master) for value, shard in zip(values, shards, strict=True)
            ):
                for shard, value in zip(shards, values, strict=True):
                    if value is not None:
                        yield shard, name, value, False
                continue
            dtype = next(v.dtype for v, s in zip(values, shards, strict=True) if _is_elementwise(v, s.master))
            if ddp.zero_stage == 0:
                flat_state = torch.zeros(bucket.padded_numel, dtype=dtype)
                for shard, value in zip(shards, values, strict=True):
                    flat_state[shard.slot.offset : shard.slot.offset + shard.slot.numel].copy_(value)
            else:
                chunk = torch.zeros(bucket.chunk_numel, dtype=dtype)
                for shard, value in zip(shards, values, strict=True):
                    begin = shard.slot.offset + shard.start - chunk_start
                    chunk[begin : begin + shard.end - shard.start].copy_(value)
                flat_state = torch.empty(bucket.padded_numel, dtype=dtype)
                all_gather_flat(flat_state, chunk, group=ddp.dp_group)
            for shard in shards:
                local = flat_state[shard.slot.offset : shard.slot.offset + shard.slot.numel]
                yield shard, name, local.view(shard.slot.local_shape), True


def _gathered_ddp_state(optimizer: DistributedOptimizer) -> dict[str, dict[str, Any]]:
    state: dict[str, dict[str, Any]] = {}
    for shard, name, value, elementwise in local_states(optimizer):
        if elementwise:
            state.setdefault(shard.fqn, {})[name] = _to_global(shard.param, value)
        else:
            state.setdefault(shard.fqn, {})[name] = value.clone() if torch.is_tensor(value) else value
    return state


def optimizer_state(optimizer: DistributedOptimizer) -> dict[str, Any]:
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


def _local_part(
    optimizer: DistributedOptimizer, fqn: str, master: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    if not isinstance(optimizer.owner, DDP):
        return distribute_tensor(value, master.device_mesh, master.placements, src_data_rank=None)
    shard = next(shard for shard in optimizer.shards.values() if shard.master is master)
    return master_part(shard, fqn, value)


def master_part(shard: ParamShard, fqn: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's range (``shard.master``'s elements) of a state tensor shaped like the parameter:
    a global tensor, or a DTensor laid out like the parameter.

    Example::

        optimizer.state[shard.master]["exp_avg"] = master_part(shard, "fc.weight", global_exp_avg)
    """
    param = shard.param
    local = value
    if isinstance(value, DTensor):
        local = value.redistribute(param.device_mesh, param.placements).to_local()
    elif isinstance(param, DTensor):
        local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
    if local.numel() != local_tensor(param).numel():
        raise DataParallelConfigError(
            f"optimizer state of {fqn!r} has shape {tuple(value.shape)}; "
            f"the parameter's is {tuple(param.shape)}"
        )
    return local.reshape(-1)[shard.start : shard.end].to(shard.master.dtype).clone()


def load_optimizer_state(optimizer: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
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
    for fqn, saved_state in state_dict["state"].items():
        master = masters[fqn]
        optimizer.state[master] = {
            name: _local_part(optimizer, fqn, master, value)
            if isinstance(value, torch.Tensor) and value.dim() >= 1
            else (value.clone() if torch.is_tensor(value) else value)
            for name, value in saved_state.items()
        }
