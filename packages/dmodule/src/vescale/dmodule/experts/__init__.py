"""Expert parallelism for unmodified ``transformers`` mixture-of-experts models.

Experts are sharded over the ``ep`` mesh dim (E/ep whole experts per rank), tokens reach
them by all-to-all with variable splits and come back in their original order, and the
router's load-balancing loss is computed from the statistics of the whole global batch.

Example::

    parallelize_experts(model, init_mesh(dp=2, ep=2))
    model(input_ids=ids, labels=ids).loss.backward()
    average_gradients(model, mesh)    # experts over dp, everything else over dp x ep
"""

from vescale.dmodule.experts.aux_loss import (
    attach_global_aux_loss,
    carry_router_statistics,
    computes_load_balancing_loss,
    global_load_balancing_loss,
    load_balancing_loss,
)
from vescale.dmodule.experts.detect import MoEBlock, find_moe_blocks
from vescale.dmodule.experts.dispatch import RoutePlan, all_to_all, dispatch_and_combine, plan_routes
from vescale.dmodule.experts.errors import ExpertParallelError, UnsupportedExpertsError
from vescale.dmodule.experts.gradients import average_gradients, gradient_reduction_dims
from vescale.dmodule.experts.local_experts import LocalExperts, grouped_mm_supported
from vescale.dmodule.experts.parallelize import (
    ExpertParallelState,
    batch_dims_of,
    dropped_pairs,
    expert_parallel_state,
    is_expert_parameter,
    parallelize_experts,
)
from vescale.dmodule.experts.router_precision import route_in_float32
from vescale.dmodule.experts.router_statistics import (
    RouterStatistics,
    load_balancing_statistics,
    router_statistics_of,
)
from vescale.dmodule.experts.sharding import expert_parameter_fqns, tensor_parallel_outside_experts

__all__ = [
    "ExpertParallelError",
    "ExpertParallelState",
    "LocalExperts",
    "MoEBlock",
    "RoutePlan",
    "RouterStatistics",
    "UnsupportedExpertsError",
    "all_to_all",
    "attach_global_aux_loss",
    "average_gradients",
    "batch_dims_of",
    "carry_router_statistics",
    "computes_load_balancing_loss",
    "dispatch_and_combine",
    "dropped_pairs",
    "expert_parallel_state",
    "expert_parameter_fqns",
    "find_moe_blocks",
    "global_load_balancing_loss",
    "gradient_reduction_dims",
    "grouped_mm_supported",
    "is_expert_parameter",
    "load_balancing_loss",
    "load_balancing_statistics",
    "parallelize_experts",
    "plan_routes",
    "route_in_float32",
    "router_statistics_of",
    "tensor_parallel_outside_experts",
]
