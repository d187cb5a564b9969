"""``DistributedOptimizer``: any ``torch.optim`` optimizer stepping under a model's ZeRO stage.

Build the optimizer after :func:`~vescale.doptim.data_parallel` (or ``DDP``) was applied,
then wrap it. Under stages 0-2 its parameter groups are kept (same dicts, same
hyper-parameters) but each parameter in them is replaced by this rank's master tensor
(:mod:`vescale.doptim.zero`): the whole local tensor under stage 0, this rank's ragged
range under stages 1 and 2, so the optimizer state it creates is sharded over dp. This
needs an element-wise optimizer (SGD, Adam, AdamW and the like). Under stage 3 the
optimizer steps FSDP2's sharded parameters as they are. The wrapper is a
``torch.optim.Optimizer`` sharing the inner ``param_groups``, so LR schedulers work on it
unchanged; ``state_dict()`` speaks single-device terms (:mod:`vescale.doptim.state_dict`) and
``checkpoint_view()`` is what a parameter-keyed checkpoint saves (:mod:`vescale.doptim.checkpoint_view`).

Example::

    model = data_parallel(model, mesh, zero_stage=1)
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from vescale.doptim.checkpoint_view import OptimizerCheckpointView
from vescale.doptim.clip import GradPiece, is_pipeline_copy, sharded_mesh_dims
from vescale.doptim.data_parallel import FullyShardedState
from vescale.doptim.ddp import DDP, data_parallel_of
from vescale.doptim.errors import DataParallelConfigError, OptimizerOrderError
from vescale.doptim.mesh_groups import mesh_dim_names
from vescale.doptim.state_dict import load_optimizer_state, optimizer_state
from vescale.doptim.zero import ParamShard, build_param_shards, load_grads, publish_params

__all__ = ["DistributedOptimizer"]


def _data_parallel_owner(optimizer: Optimizer) -> DDP | FullyShardedState:
    owners = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            owner = data_parallel_of(param)
            if owner is None:
                raise OptimizerOrderError(
                    f"param_groups[{group_index}]['params'][{param_index}] (shape {tuple(param.shape)}) "
                    "is not a parameter of a data-parallel model. Apply the stage first, then build the "
                    "optimizer: "
                    "data_parallel(model, mesh, zero_stage=...); DistributedOptimizer(optimizer_fn(model))"
                )
            owners[id(owner)] = owner
    if len(owners) != 1:
        raise DataParallelConfigError(
            f"the optimizer's parameters belong to {len(owners)} data-parallel models; "
            "use one optimizer per model"
        )
    return next(iter(owners.values()))


class DistributedOptimizer(Optimizer):
    """Step ``optimizer`` under the ZeRO stage of the model its parameters belong to.

    ``master_dtype`` (stages 0-2) is the narrowest dtype of the stepped tensors and of the
    optimizer state: ``torch.float32`` keeps fp32 master weights for bf16 parameters and steps
    float32 and float64 ones in their own dtype, in place; ``None`` steps each parameter in its
    own dtype.

    Example::

        optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        clip_grad_norm_(optimizer, 1.0); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, optimizer: Optimizer, *, master_dtype: torch.dtype | None = torch.float32) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise DataParallelConfigError("the optimizer is a DistributedOptimizer already; wrap it once")
        if optimizer.state:
            raise OptimizerOrderError(
                "the optimizer has state already (it has stepped); wrap it in DistributedOptimizer "
                "right after building it, before the first step"
            )
        self.optimizer = optimizer
        # A frozen parameter (requires_grad=False, e.g. AFMoE's router expert_bias) never gets a
        # gradient, so a torch optimizer never steps it, and data parallelism leaves it out: drop it.
        for group in optimizer.param_groups:
            group["params"] = [param for param in group["params"] if param.requires_grad]
        self.owner = _data_parallel_owner(optimizer)
        self.zero_stage = self.owner.zero_stage
        self.defaults = optimizer.defaults
        self.shards: dict[int, ParamShard] = {}
        if isinstance(self.owner, DDP):
            self.shards = build_param_shards(self.owner, master_dtype=master_dtype)
            for group in optimizer.param_groups:
                group["params"] = [self.shards[id(param)].master for param in group["params"]]
        self._grads_loaded = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's parameter groups (the same dicts: LR schedulers change them)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's state, keyed by this rank's master tensors (sharded under ZeRO >= 1)."""
        return self.optimizer.state

    def prepare_grads(self) -> None:
        """Wait for the gradient reductions and hand the averaged gradients to the master tensors."""
        if self._grads_loaded:
            return
        self.owner.finish_grad_sync()
        if isinstance(self.owner, DDP):
            load_grads(self.owner, self.shards)
        self._grads_loaded = True

    def grad_pieces(self) -> list[GradPiece]:
        """The gradients this rank steps, with the mesh dims they are sharded over (for clipping)."""
        self.prepare_grads()
        if isinstance(self.owner, FullyShardedState):
            params = [
                param for group in self.param_groups for param in group["params"] if param.grad is not None
            ]
            return [
                # Each parameter's own mesh: over several dp dims (dp x ep) FSDP2 puts the non-expert
                # parameters on a mesh with those dims flattened into one.
                GradPiece(
                    param.grad.to_local(),
                    param.device_mesh,
                    sharded_mesh_dims(param),
                    is_pipeline_copy(param),
                )
                for param in params
            ]
        names = mesh_dim_names(self.owner.device_mesh)
        return [
            GradPiece(
                shard.master.grad,
                self.owner.device_mesh,
                sharded_mesh_dims(shard.param) | self._chunked_dims(shard, names),
                is_pipeline_copy(shard.param),
            )
            for shard in self.shards.values()
            if shard.master.grad is not None
        ]

    def _chunked_dims(self, shard: ParamShard, names: tuple[str, ...]) -> frozenset[int]:
        """The mesh dims over which ZeRO 1-2 split ``shard``'s bucket into chunks (its reduction dims)."""
        if self.zero_stage == 0:
            return frozenset()
        return frozenset(names.index(dim) for dim in shard.bucket_and_slot()[0].reduction_group.dims)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the inner optimizer on this rank's masters, then update every rank's parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.prepare_grads()
        self.optimizer.step()
        if isinstance(self.owner, DDP):
            publish_params(self.owner, self.shards)
            self.owner.gradients_consumed()
        self._grads_loaded = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the masters' (``set_to_none=False`` zeroes them in place)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if isinstance(self.owner, DDP):
            # ZeRO-2's reduced chunks accumulate over the backward passes until here, as .grad does.
            self.owner.release_grad_chunks()
            self.owner.gradients_consumed()
        for shard in self.shards.values():
            if set_to_none:
                shard.param.grad = None
            elif shard.param.grad is not None:
                shard.param.grad.zero_()
        self._grads_loaded = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: groups must exist when the stage shards them."""
        raise DataParallelConfigError(
            "DistributedOptimizer cannot add parameter groups after wrapping; "
            "build the optimizer with all of them"
        )

    def state_dict(self) -> dict[str, Any]:
        """The state in single-device terms: per parameter FQN, global shapes."""
        return optimizer_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` under any dp size or ZeRO stage."""
        load_optimizer_state(self, state_dict)

    def checkpoint_view(self) -> OptimizerCheckpointView:
        """This optimizer keyed by the model's parameters, its state as dp-sharded DTensors: what a
        checkpoint library keying state by parameter (``vescale.dcheckpoint``) saves and loads into.
        Collective; build a new one for every save and load.

        Example::

            dcheckpoint.save("ckpt/step-10", {"model": model, "optimizer": optimizer.checkpoint_view()})
            dcheckpoint.load("ckpt", {"model": model, "optimizer": optimizer.checkpoint_view()})
        """
        return OptimizerCheckpointView(self)

    def __repr__(self) -> str:
        return f"DistributedOptimizer(zero_stage={self.zero_stage}, {self.optimizer!r})"
