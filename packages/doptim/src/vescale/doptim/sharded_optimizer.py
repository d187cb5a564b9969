"""What the state functions need of a data-parallel optimizer, as a protocol.

:class:`~vescale.doptim.DistributedOptimizer` owns the optimizer; its single-device state dict
(:mod:`vescale.doptim.state_dict`) and its checkpoint view (:mod:`vescale.doptim.checkpoint_view`)
are functions over the few attributes named here. They take a :class:`ShardedOptimizer`, not
the class, so that the class can call them without the modules importing one another.

Example::

    def fqns(optimizer: ShardedOptimizer) -> list[str]:
        return [shard.fqn for shard in optimizer.shards.values()]
"""

from __future__ import annotations

from typing import Any, Protocol

from vescale.doptim.data_parallel import FullyShardedState
from vescale.doptim.ddp import DDP
from vescale.doptim.zero import ParamShard

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(Protocol):
    """An optimizer stepping this rank's master tensors of a data-parallel model.

    ``owner`` is the model's data parallelism (``DDP`` under ZeRO 0-2, FSDP2's state under
    ZeRO-3); ``shards`` maps ``id(parameter)`` to its :class:`~vescale.doptim.zero.ParamShard`
    (empty under ZeRO-3); ``state`` and ``param_groups`` are the inner optimizer's, keyed by
    the masters.

    Example::

        optimizer: ShardedOptimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        optimizer.owner.zero_stage, len(optimizer.shards)
    """

    @property
    def owner(self) -> DDP | FullyShardedState: ...

    @property
    def shards(self) -> dict[int, ParamShard]: ...

    @property
    def defaults(self) -> dict[str, Any]: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    @property
    def state(self) -> Any: ...
