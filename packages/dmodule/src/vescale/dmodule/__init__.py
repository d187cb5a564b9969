"""DModule: zero-code-change tensor and sequence parallelism for ``torch.nn.Module``,
deferred initialisation and automatic sharding plans.

Example::

    model = vescale.dmodule.deferred_init(LlamaForCausalLM, config)       # nothing allocated
    plan = vescale.dmodule.auto_sharding_plan(model, sequence_parallel=True)
    vescale.dmodule.parallelize_module(model, init_mesh(dp=2, tp=2), plan)  # each rank: its shards
"""

from importlib.metadata import version as _distribution_version

from vescale.dmodule.auto_plan import AutoShardingResult, auto_sharding_plan, plan_tensor_parallel
from vescale.dmodule.debug import format_placements
from vescale.dmodule.deferred import deferred_init, materialize_module
from vescale.dmodule.errors import DModuleError, ShardingPlanError
from vescale.dmodule.local_execution import local_execution_report
from vescale.dmodule.parallelize import is_dmodule, parallelize_module
from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.dtensor.grad_sync import finish_grad_sync

__all__ = [
    "AutoShardingResult",
    "DModuleError",
    "ShardingPlan",
    "ShardingPlanError",
    "__version__",
    "auto_sharding_plan",
    "deferred_init",
    "finish_grad_sync",
    "format_placements",
    "is_dmodule",
    "local_execution_report",
    "materialize_module",
    "parallelize_module",
    "plan_tensor_parallel",
]

__version__ = _distribution_version("vescale-dmodule")
from vescale.dmodule.experts import parallelize_experts as parallelize_experts
