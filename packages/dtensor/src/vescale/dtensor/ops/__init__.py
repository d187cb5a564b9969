"""veScale's DTensor sharding strategies, one module per op family; importing registers them
(and installs the all-to-all redistribution of :mod:`vescale.dtensor.shard_alltoall`, and
redistribution plans that leave a mesh dim on which a tensor stays Replicate untouched).

Everything here extends stock PyTorch through ``register_sharding`` (public) or, where a
strategy needs more, through :mod:`vescale.dtensor._compat`. :mod:`.coverage` reports
which ops of a run DTensor can shard.

Example::

    import vescale.dtensor.ops
    from vescale.dtensor.ops import OpCoverageRecorder
    with OpCoverageRecorder() as recorder:
        model(input_ids).logits.sum().backward()
"""

# Shard(i) -> Shard(j) as one all-to-all on every backend is part of the same completion of DTensor.
import vescale.dtensor.shard_alltoall  # noqa: F401
from vescale.dtensor import _compat
from vescale.dtensor.ops import (
    attention,
    backports,
    concat,
    data_dependent,
    elementwise,
    grouped_mm,
    index_accumulate,
    layouts,
    loss,
    masked_fill,
    scalars,
    strided_shard,
    unfold,
    views,
)
from vescale.dtensor.ops.coverage import OpCoverageRecorder, OpCoverageReport, has_sharding_strategy, op_name

# The redistributions that strategies insert must not mix the batches held under a Replicate
# data-parallel mesh dim (see _compat.install_replicate_dims_guard).
_compat.install_replicate_dims_guard()
_compat.install_batch_dims_strategy_guard()
# ... and, the guard being in place, torch builds only the candidates it can choose from.
_compat.install_batch_dims_expansion()

__all__ = [
    "OpCoverageRecorder",
    "OpCoverageReport",
    "attention",
    "backports",
    "concat",
    "data_dependent",
    "elementwise",
    "grouped_mm",
    "has_sharding_strategy",
    "index_accumulate",
    "layouts",
    "loss",
    "masked_fill",
    "op_name",
    "scalars",
    "strided_shard",
    "unfold",
    "views",
]
