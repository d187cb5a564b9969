"""Find the mixture-of-experts blocks of an unmodified ``transformers`` 5 model.

An MoE block is a module with a fused **experts** child (``transformers``' layout: 3-D
parameters ``gate_up_proj`` or ``up_proj`` and ``down_proj`` whose first dim is the expert,
optionally with ``*_bias`` of shape (experts, out)) next to a top-k **router** (``gate`` or
``router``, a 2-D ``weight`` of shape (experts, hidden)) and, in some models, **shared
experts** that every token passes through (DeepSeek-V3). Dense layers (DeepSeek-V3's first
``first_k_dense_replace``, Qwen3-MoE's ``mlp_only_layers``) have no experts child and are
left out. The router's scoring (softmax or sigmoid) and group-limited routing are read from
the router for the report only: the router runs unchanged on each rank's own tokens.

Example::

    for block in find_moe_blocks(model):
        print(block.experts_fqn, block.num_experts, block.top_k, block.scoring)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from vescale.dmodule.experts.errors import UnsupportedExpertsError

__all__ = ["ROUTER_NAMES", "SHARED_EXPERT_NAMES", "MoEBlock", "expert_parameter_names", "find_moe_blocks"]

ROUTER_NAMES = ("gate", "router")
SHARED_EXPERT_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
_UP_NAMES = ("gate_up_proj", "up_proj")


@dataclass(frozen=True)
class MoEBlock:
    """One MoE block: FQNs of its parts and what its router does."""

    fqn: str
    experts_fqn: str
    router_fqn: str | None
    shared_experts_fqn: str | None
    num_experts: int
    top_k: int | None
    scoring: str
    group_limited: bool
    expert_parameters: tuple[str, ...]


def _is_fused_experts(module: nn.Module) -> bool:
    down = module._parameters.get("down_proj")
    up = next((module._parameters.get(name) for name in _UP_NAMES if name in module._parameters), None)
    return down is not None and up is not None and down.ndim == 3 and up.ndim == 3


def _num_experts(experts: nn.Module) -> int:
    down_proj = experts._parameters.get("down_proj")
    if down_proj is None:  # _is_fused_experts chose the module for its 3-dim down_proj
        raise UnsupportedExpertsError(
            f"{type(experts).__name__} has no down_proj parameter; expert parallelism needs the fused "
            "experts weights (gate_up_proj/up_proj and down_proj): leave this model's experts replicated"
        )
    return int(down_proj.shape[0])


def expert_parameter_names(experts: nn.Module) -> tuple[str, ...]:
    """The experts module's own parameters that have the expert dim first (weights and biases).

    Example::

        expert_parameter_names(model.model.layers[0].mlp.experts)   # ('gate_up_proj', 'down_proj')
    """
    num_experts = _num_experts(experts)
    return tuple(
        name
        for name, param in experts._parameters.items()
        if param is not None and param.ndim >= 2 and param.shape[0] == num_experts
    )


def _router_scoring(router: nn.Module) -> str:
    try:
        source = inspect.getsource(type(router).forward)
    except (OSError, TypeError):
        return "unknown"
    if "sigmoid" in source:
        return "sigmoid"
    if "softmax" in source:
        return "softmax"
    return "unknown"


def _top_k(router: nn.Module | None, experts: nn.Module) -> int | None:
    for owner in (router, experts, getattr(experts, "config", None)):
        for name in ("top_k", "num_experts_per_tok"):
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int):
                return value
    return None


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every MoE block of ``model`` (fused experts with a router beside them), in module order.

    Example::

        blocks = find_moe_blocks(model)
        assert [b.experts_fqn for b in blocks] == ["model.layers.1.mlp.experts", ...]
    """
    blocks = []
    for fqn, block in model.named_modules():
        experts = block._modules.get("experts")
        if experts is None or not _is_fused_experts(experts):
            continue
        num_experts = _num_experts(experts)
        router_name = next(
            (
                name
                for name in ROUTER_NAMES
                if isinstance(block._modules.get(name), nn.Module)
                and getattr(block._modules[name], "weight", None) is not None
                and block._modules[name].weight.shape[0] == num_experts
            ),
            None,
        )
        router = block._modules[router_name] if router_name else None
        shared_name = next((name for name in SHARED_EXPERT_NAMES if name in block._modules), None)
        prefix = f"{fqn}." if fqn else ""
        blocks.append(
            MoEBlock(
                fqn=fqn,
                experts_fqn=f"{prefix}experts",
                router_fqn=f"{prefix}{router_name}" if router_name else None,
                shared_experts_fqn=f"{prefix}{shared_name}" if shared_name else None,
                num_experts=num_experts,
                top_k=_top_k(router, experts),
                scoring=_router_scoring(router) if router is not None else "unknown",
                group_limited=router is not None
                and (getattr(router, "num_group", None) or getattr(router, "n_group", None) or 1) > 1,
                expert_parameters=expert_parameter_names(experts),
            )
        )
    return blocks
