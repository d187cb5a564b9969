"""Data parallel and ZeRO stages 0-3 over any ``torch.optim`` optimizer, composed with
tensor parallel.

Apply a stage to the model, build the optimizer, wrap it::

    model = vescale.doptim.data_parallel(model, init_mesh(dp=2, tp=2), zero_stage=1)
    optimizer = vescale.doptim.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    vescale.doptim.clip_grad_norm_(optimizer, 1.0); optimizer.step(); optimizer.zero_grad()

``DDP`` is stage 0-2's gradient averaging on its own (buckets, overlap, ``no_sync``,
``deterministic=True`` for rank-ordered, bitwise reproducible sums).

Example::

    import vescale.doptim
    print(vescale.doptim.__version__)
"""

from importlib.metadata import version as _distribution_version

from vescale.doptim.checkpoint_view import OptimizerCheckpointView
from vescale.doptim.clip import clip_grad_norm_
from vescale.doptim.data_parallel import ZERO_STAGES, data_parallel
from vescale.doptim.ddp import DDP, data_parallel_of
from vescale.doptim.errors import (
    DataParallelConfigError,
    DataParallelMeshError,
    DOptimError,
    OptimizerOrderError,
)
from vescale.doptim.optimizer import DistributedOptimizer
from vescale.doptim.plan import DataParallelPlan

__all__ = [
    "DDP",
    "ZERO_STAGES",
    "DOptimError",
    "DataParallelConfigError",
    "DataParallelMeshError",
    "DataParallelPlan",
    "DistributedOptimizer",
    "OptimizerCheckpointView",
    "OptimizerOrderError",
    "__version__",
    "clip_grad_norm_",
    "data_parallel",
    "data_parallel_of",
]

__version__ = _distribution_version("vescale-doptim")
"""vescale-doptim installs as the distribution it declares."""
