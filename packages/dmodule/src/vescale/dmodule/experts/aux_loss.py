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

__all__ = ["attach_global_aux_loss", "computes_load_balancing_loss", "global_load_balancing_loss"]

logger = logging.getLogger("vescale.dmodule")

# The module a model's causal LM computes the loss with must define this function.
_HF_LOSS_FUNCTION = "load_balancing_loss_func"
_HF_LOSS_ATTRIBUTES = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")


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


def _single_device_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a tensor-parallel model's router logits, its loss) as the tensor it stands for."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


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
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_logits in router_logits:
        probabilities = torch.softmax(_single_device_value(layer_logits).to(device).float(), dim=-1)
        selected = torch.topk(probabilities, top_k, dim=-1).indices.reshape(-1)
        row_weights = torch.ones(probabilities.shape[0], device=device) if flat_mask is None else flat_mask
        counts = counts.scatter_add(0, selected, row_weights.repeat_interleave(top_k))
        probability_sums = probability_sums + (probabilities * row_weights.unsqueeze(-1)).sum(dim=0)
        rows = rows + row_weights.sum()
    statistics = torch.cat([probability_sums, counts, rows])
    if groups:
        # torch leaves Function.apply and Tensor.split unannotated.
        statistics = _AllReduceSum.apply(statistics, tuple(groups))  # type: ignore[no-untyped-call]
    probability_sums, counts, rows = statistics.split([num_experts, num_experts, 1])  # type: ignore[no-untyped-call]
    return torch.sum((counts.detach() / rows.detach()) * (probability_sums / rows.detach())) * num_experts


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


def attach_global_aux_loss(
    model: nn.Module, mesh: DeviceMesh, *, batch_dims: Sequence[str] = ("dp",)
) -> RemovableHandle | None:
    """Make ``model``'s load-balancing loss that of the global batch split over ``batch_dims``.

    Returns the hook's handle, or ``None`` when the model computes no such loss.

    Example::

        handle = attach_global_aux_loss(model, init_mesh(dp=4), batch_dims=("dp",))
        handle.remove()   # back to the per-rank statistic
    """
    if not computes_load_balancing_loss(model):
        logger.debug("%s adds no load-balancing loss; nothing to make global", type(model).__name__)
        return None
    groups = _batch_groups(mesh, batch_dims)
    signature = inspect.signature(model.forward)

    # ``module`` is the transformers model: num_experts and the loss coefficient are its own.
    def replace_with_global(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        local = output.get("aux_loss") if isinstance(output, dict) else None
        router_logits = output.get("router_logits") if isinstance(output, dict) else None
        if not isinstance(local, torch.Tensor) or not router_logits:
            return None
        attention_mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
        total = global_load_balancing_loss(
            router_logits, module.num_experts, module.num_experts_per_tok, attention_mask, groups
        )
        loss = output.get("loss")
        if loss is not None:
            correction = module.router_aux_loss_coef * (total - _single_device_value(local)).to(loss.device)
            if isinstance(loss, DTensor):
                replicate = [Replicate()] * loss.device_mesh.ndim
                correction = DTensor.from_local(correction, loss.device_mesh, replicate, run_check=False)
            output["loss"] = loss + correction
        output["aux_loss"] = total
        return output

    return model.register_forward_hook(replace_with_global, with_kwargs=True)
