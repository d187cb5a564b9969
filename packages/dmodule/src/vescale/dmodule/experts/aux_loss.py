"""The router's load-balancing loss from the statistics of the whole global batch.

``transformers``' MoE causal LMs (Mixtral, Qwen3-MoE, OLMoE, ...) add
``router_aux_loss_coef · E · Σ_e f_e · P_e`` to the loss, where f_e is the fraction of
(token, k) assignments that went to expert e and P_e its mean router probability, both
over the rows of *the batch they see*. Under data parallelism (dp, and dp×ep) each rank sees
only its share of the batch, so the loss and its gradient differ from single-device training
of the global batch (the product of two means is not the mean of the products).

:func:`attach_global_aux_loss` fixes this without changing the model: a forward hook on the
causal LM recomputes the loss from the assignment counts, probability sums and row counts
summed over every rank that holds part of the batch (one all-reduce of 2E+1 numbers per
batch-splitting mesh dim), and replaces the model's per-rank term:
``loss + coef · (global − local)`` (the local term's gradient cancels exactly) and
``aux_loss = global``. The probability sums are all-reduced differentiably (backward
all-reduces their gradient), so once a data-parallel wrapper averages the ranks' gradients,
the router gradients equal single-device training of the global batch. With gradient
accumulation the statistic is the micro-batch's (every micro-batch's ranks together).

Under a pipeline each stage runs only its layers: the statistics are recorded router by router
and carried from stage to stage (:mod:`.router_statistics`, :func:`carry_router_statistics`),
and the last stage's hook computes the loss of every layer from them.

Models without such a loss (DeepSeek-V3 returns its router logits but adds no loss) are left
alone; no model here has a router z-loss.

Example::

    attach_global_aux_loss(model, mesh, batch_dims=("dp",))
    out = model(input_ids=ids, labels=labels)   # out.loss, out.aux_loss: global-batch statistic
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.hooks import RemovableHandle

from vescale.dmodule.experts.errors import ExpertParallelError
from vescale.dmodule.experts.router_statistics import (
    RouterStatistics,
    load_balancing_statistics,
    record_router_statistics,
    router_statistics_of,
    single_device_value,
)
from vescale.dtensor.grouped_mm_shapes import holds_no_data

__all__ = [
    "attach_global_aux_loss",
    "carry_router_statistics",
    "computes_load_balancing_loss",
    "global_load_balancing_loss",
    "load_balancing_loss",
]

logger = logging.getLogger("vescale.dmodule")

# The module a model's causal LM computes the loss with must define this function.
_HF_LOSS_FUNCTION = "load_balancing_loss_func"
_HF_LOSS_ATTRIBUTES = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
# The causal LM keeps the handle of its global-loss hook under this attribute.
_HOOK_ATTRIBUTE = "_vescale_global_aux_loss"


class _AllReduceSum(torch.autograd.Function):
    """Sum over every group in turn; backward sums the gradient the same way."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, groups: tuple[Any, ...]) -> torch.Tensor:
        ctx.groups = groups
        total = values.clone()
        for group in groups:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(total, group=group)
        return total, None


def load_balancing_loss(
    statistics: torch.Tensor, num_experts: int, groups: Sequence[Any] = ()
) -> torch.Tensor:
    """``E · Σ_e f_e · P_e`` from :func:`load_balancing_statistics` summed over every rank in ``groups``.

    The sum over ranks is differentiable (its backward sums the gradient the same way); only the
    probability sums carry a gradient, as in ``transformers`` (its counts come from top-k indices).

    Example::

        aux = load_balancing_loss(statistics, 8, groups=[mesh.get_group("dp")])
    """
    if groups:
        # torch leaves Function.apply unannotated.
        statistics = _AllReduceSum.apply(statistics, tuple(groups))  # type: ignore[no-untyped-call]
    probability_sums, counts, rows = statistics.split([num_experts, num_experts, 1])  # type: ignore[no-untyped-call]
    return torch.sum((counts.detach() / rows.detach()) * (probability_sums / rows.detach())) * num_experts


def global_load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    groups: Sequence[Any] = (),
) -> torch.Tensor:
    """``transformers``' ``load_balancing_loss_func`` over the rows of every rank in ``groups``.

    ``router_logits``: one (rows, E) tensor per MoE layer; ``groups``: the process groups that
    together hold the global batch (empty: this process's rows only, as ``transformers``).

    Example::

        aux = global_load_balancing_loss(out.router_logits, 8, 2, groups=[mesh.get_group("dp")])
    """
    statistics = load_balancing_statistics(router_logits, num_experts, top_k, attention_mask)
    return load_balancing_loss(statistics, num_experts, groups)


def computes_load_balancing_loss(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` causal LM that adds ``load_balancing_loss_func``.

    Example::

        computes_load_balancing_loss(MixtralForCausalLM(config))   # True; DeepSeek-V3: False
    """
    module = sys.modules.get(type(model).__module__)
    return (
        module is not None
        and callable(getattr(module, _HF_LOSS_FUNCTION, None))
        and all(hasattr(model, name) for name in _HF_LOSS_ATTRIBUTES)
    )


def _batch_groups(mesh: DeviceMesh, batch_dims: Sequence[str]) -> tuple[Any, ...]:
    names = mesh.mesh_dim_names or ()
    missing = [dim for dim in batch_dims if dim not in names]
    if missing:
        raise ExpertParallelError(
            f"batch_dims {tuple(batch_dims)} name {missing}, which the mesh (dims {names}) does not have; "
            "pass the mesh dims the global batch is split over, e.g. ('dp', 'ep')"
        )
    return tuple(mesh.get_group(dim) for dim in batch_dims if mesh.size(names.index(dim)) > 1)


def _replace_with_global(groups: tuple[Any, ...], signature: inspect.Signature) -> Any:
    # ``module`` is the transformers model: num_experts and the loss coefficient are its own.
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not isinstance(output, dict):
            return None
        local = output.get("aux_loss")
        if local is None:
            return None  # called with output_router_logits=False: no load-balancing loss
        recorded = router_statistics_of(module)
        if recorded is not None and recorded.active and recorded.value is not None:
            # A pipeline's last stage: every layer's statistics, earlier stages' included.
            statistics = recorded.value
        else:
            router_logits = output.get("router_logits")
            if not isinstance(local, torch.Tensor) or not router_logits or holds_no_data(local):
                return None  # no loss, or a pass without data (dpipe's trace): nothing to exchange
            attention_mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
            statistics = load_balancing_statistics(
                router_logits, module.num_experts, module.num_experts_per_tok, attention_mask
            )
        total = load_balancing_loss(statistics, module.num_experts, groups)
        loss = output.get("loss")
        if loss is not None:
            # transformers added coef * its own term (0 on a stage whose layers have no router).
            local_value = single_device_value(local) if isinstance(local, torch.Tensor) else 0.0
            correction = module.router_aux_loss_coef * (total - local_value).to(loss.device)
            if isinstance(loss, DTensor):
                replicate = [Replicate()] * loss.device_mesh.ndim
                correction = DTensor.from_local(correction, loss.device_mesh, replicate, run_check=False)
            output["loss"] = loss + correction
        output["aux_loss"] = total
        return output

    return hook


def attach_global_aux_loss(
    model: nn.Module, mesh: DeviceMesh | None, *, batch_dims: Sequence[str] = ("dp",)
) -> RemovableHandle | None:
    """Make ``model``'s load-balancing loss that of the global batch split over ``batch_dims``.

    Returns the hook's handle, or ``None`` when the model computes no such loss. Attaching again
    replaces the previous hook (the last ``batch_dims`` hold). Under a pipeline the loss is that
    of every layer, whichever stage ran it (:func:`carry_router_statistics`). ``mesh`` may be
    ``None`` with no ``batch_dims`` (one process holds the whole batch).

    Example::

        handle = attach_global_aux_loss(model, init_mesh(dp=4), batch_dims=("dp",))
        handle.remove()   # back to the per-rank statistic
    """
    if not computes_load_balancing_loss(model):
        logger.debug("%s adds no load-balancing loss; nothing to make global", type(model).__name__)
        return None
    if mesh is None and batch_dims:
        raise ExpertParallelError(
            f"batch_dims {tuple(batch_dims)} name mesh dims but no mesh was given; pass the mesh the "
            "batch is split over, or batch_dims=() for one process's batch"
        )
    groups = _batch_groups(mesh, batch_dims) if mesh is not None else ()
    previous: RemovableHandle | None = getattr(model, _HOOK_ATTRIBUTE, None)
    if previous is not None:
        previous.remove()
    handle = model.register_forward_hook(
        _replace_with_global(groups, inspect.signature(model.forward)), with_kwargs=True
    )
    setattr(model, _HOOK_ATTRIBUTE, handle)
    return handle


def carry_router_statistics(model: nn.Module) -> RouterStatistics | None:
    """For a pipeline: record ``model``'s router statistics stage by stage (see :mod:`.router_statistics`)
    and compute its load-balancing loss from all of them; ``None`` when the model has no such loss.

    Keeps the hook :func:`attach_global_aux_loss` attached (its batch dims), else attaches one for
    this process's batch. dpipe calls it and sends :attr:`RouterStatistics.value` between stages.

    Example::

        statistics = carry_router_statistics(model)   # then pipeline_parallelize(model, ...)
    """
    if not computes_load_balancing_loss(model):
        return None
    # computes_load_balancing_loss checked that the transformers model has both (int) attributes.
    causal_lm: Any = model
    statistics = record_router_statistics(
        model, int(causal_lm.num_experts), int(causal_lm.num_experts_per_tok)
    )
    if getattr(model, _HOOK_ATTRIBUTE, None) is None:
        attach_global_aux_loss(model, None, batch_dims=())
    return statistics
