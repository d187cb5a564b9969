"""A tensor-parallel sharding plan that leaves the experts alone, for expert parallelism.

Expert parallelism shards whole experts over ``ep``; a plan made for tensor parallelism
(``plan_tensor_parallel``) also splits the experts' 3-D weights over ``tp``. With
``expert_tensor_parallel`` off, the plan applied is the same plan without the entries of the
experts' own parameters: tensor parallelism then runs outside the experts only (attention,
dense MLPs, shared experts, the router stays as planned), and ``parallelize_experts`` shards
the experts over ``ep`` afterwards.

Example::

    plan = tensor_parallel_outside_experts(plan_tensor_parallel(model).plan, model)
    parallelize_module(model, mesh, plan, mesh_dim="tp"); parallelize_experts(model, mesh)
"""

from __future__ import annotations

import re

from torch import nn

from vescale.dmodule.experts.detect import find_moe_blocks
from vescale.dmodule.experts.errors import ExpertParallelError
from vescale.dmodule.sharding_plan import ShardingPlan

__all__ = ["expert_parameter_fqns", "tensor_parallel_outside_experts"]


def expert_parameter_fqns(model: nn.Module) -> frozenset[str]:
    """The FQNs of every MoE block's expert parameters (3-D weights and their biases).

    Example::

        "model.layers.0.mlp.experts.down_proj" in expert_parameter_fqns(model)   # True
    """
    return frozenset(
        f"{block.experts_fqn}.{name}" for block in find_moe_blocks(model) for name in block.expert_parameters
    )


def _matches(pattern: str, fqns: frozenset[str] | set[str]) -> list[str]:
    compiled = re.compile(pattern)
    return sorted(fqn for fqn in fqns if compiled.fullmatch(fqn))


def tensor_parallel_outside_experts(sharding_plan: ShardingPlan, model: nn.Module) -> ShardingPlan:
    """``sharding_plan`` without the parameter (and head) entries that match an expert parameter.

    An entry matching expert and other parameters alike cannot be split: it raises
    :class:`ExpertParallelError` naming both.

    Example::

        outside = tensor_parallel_outside_experts(plan, model)   # experts left for parallelize_experts
    """
    experts = expert_parameter_fqns(model)
    if not experts:
        return sharding_plan
    others = {fqn for fqn, _ in model.named_parameters()} - experts

    def keep(pattern: str) -> bool:
        hit_experts = _matches(pattern, experts)
        if not hit_experts:
            return True
        hit_others = _matches(pattern, others)
        if hit_others:
            raise ExpertParallelError(
                f"sharding plan pattern {pattern!r} matches expert parameters ({hit_experts[0]}) and others "
                f"({hit_others[0]}); write separate patterns so the experts can be left to expert "
                "parallelism, or set expert_tensor_parallel"
            )
        return False

    return ShardingPlan(
        parameter=tuple(entry for entry in sharding_plan.parameter if keep(entry[0])),
        forward=sharding_plan.forward,
        heads=tuple(entry for entry in sharding_plan.heads if keep(entry[0])),
    )
