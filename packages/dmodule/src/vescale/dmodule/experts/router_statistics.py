"""The load-balancing loss's statistics, recorded router by router, carried across pipeline stages.

``transformers`` computes its load-balancing loss once, at the end of the causal LM's forward,
from the router logits of *every* MoE layer: ``E · Σ_e f_e · P_e`` with ``f_e`` (assignment
fractions) and ``P_e`` (mean router probabilities) taken over all layers' rows together. Under
a pipeline each stage runs only its own layers, so the last stage sees only its layers' logits.
The loss depends on the logits only through 2E+1 sums (:func:`load_balancing_statistics`):
each expert's summed probability, its assignment count and the row count; they add up over
layers. :class:`RouterStatistics` records them from hooks on the routers while a pipeline
stage runs and hands the running sum to the next stage beside the hidden state (dpipe sends it
on: :mod:`vescale.dpipe.stage_module`), so the last stage computes the loss of all layers. The
sum is a differentiable tensor: the gradient the loss sends into it flows back through the
pipeline to the routers of the earlier stages, which is exactly single-device backward.

Example::

    statistics = record_router_statistics(model, num_experts=8, top_k=2)
    statistics.start(None, batch)           # the first stage: from zero
    model(**batch)                          # the routers add their layers' statistics
    carried = statistics.finish()           # sent to the next stage with the hidden state
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vescale.dmodule._local_verification import trial_running
from vescale.dmodule.experts.errors import UnsupportedExpertsError

__all__ = [
    "ROUTER_STATISTICS_ATTRIBUTE",
    "RouterStatistics",
    "load_balancing_statistics",
    "record_router_statistics",
    "router_statistics_of",
    "single_device_value",
]

# The causal LM whose routers are recorded keeps its RouterStatistics under this attribute.
ROUTER_STATISTICS_ATTRIBUTE = "_vescale_router_statistics"
# The key of transformers' output recorders (``_can_record_outputs``) for the routers' logits.
_ROUTER_LOGITS = "router_logits"


def single_device_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a tensor-parallel model's router logits, its loss) as the tensor it stands for."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def load_balancing_statistics(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sufficient statistics of ``transformers``' ``load_balancing_loss_func`` over these layers.

    One float32 vector of 2E+1: each expert's summed router probability (differentiable), each
    expert's (token, k) assignment count, and the row count, summed over ``router_logits`` (one
    (rows, E) tensor per MoE layer). Statistics of disjoint layers or rows add up; the loss
    needs only their sum (:func:`~vescale.dmodule.experts.aux_loss.load_balancing_loss`).

    Example::

        statistics = load_balancing_statistics(out.router_logits, num_experts=8, top_k=2)
    """
    device = router_logits[0].device
    statistics = torch.zeros(2 * num_experts + 1, dtype=torch.float32, device=device)
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_logits in router_logits:
        probabilities = torch.softmax(single_device_value(layer_logits).to(device).float(), dim=-1)
        selected = torch.topk(probabilities, top_k, dim=-1).indices.reshape(-1)
        row_weights = torch.ones(probabilities.shape[0], device=device) if flat_mask is None else flat_mask
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        counts = counts.scatter_add(0, selected, row_weights.repeat_interleave(top_k))
        probability_sums = (probabilities * row_weights.unsqueeze(-1)).sum(dim=0)
        statistics = statistics + torch.cat([probability_sums, counts, row_weights.sum().reshape(1)])
    return statistics


def _router_recorder(model: nn.Module) -> tuple[type, int]:
    """The router class and the index of its logits in its output, as ``transformers`` records them."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get(_ROUTER_LOGITS)
        if isinstance(recorder, type):
            return recorder, 0
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type):
            return target, int(getattr(recorder, "index", 0) or 0)
    raise UnsupportedExpertsError(
        f"{type(model).__name__} declares no '{_ROUTER_LOGITS}' output recorder (transformers' "
        "_can_record_outputs), so its routers' logits cannot be recorded stage by stage; run it without a "
        "pipeline, or with output_router_logits=False"
    )


class RouterStatistics:
    """The running :func:`load_balancing_statistics` of one forward, fed by hooks on the routers.

    Recording happens between :meth:`start` and :meth:`finish` only (a pipeline stage's forward);
    :attr:`value` is then the sum over every layer run so far in this micro-batch, earlier
    stages' included.
    """

    def __init__(self, model: nn.Module, num_experts: int, top_k: int) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.value: torch.Tensor | None = None
        self._attention_mask: torch.Tensor | None = None
        router_class, self._logits_index = _router_recorder(model)
        self.routers = [module for module in model.modules() if isinstance(module, router_class)]
        for router in self.routers:
            router.register_forward_hook(self._record)

    @property
    def active(self) -> bool:
        """Whether a stage's forward is being recorded (between :meth:`start` and :meth:`finish`)."""
        return self.value is not None

    def zeros(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The statistics of no layer: what the first stage starts from."""
        return torch.zeros(2 * self.num_experts + 1, dtype=torch.float32, device=device)

    def start(self, received: torch.Tensor | None, batch: Mapping[str, Any]) -> None:
        """Begin recording a stage's forward of ``batch``, from the previous stage's ``received`` sum."""
        device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        self.value = received if received is not None else self.zeros(device)
        mask = batch.get("attention_mask")
        self._attention_mask = mask if isinstance(mask, torch.Tensor) else None

    def finish(self) -> torch.Tensor:
        """Stop recording; the sum to send to the next stage."""
        value = self.value if self.value is not None else self.zeros()
        self.value, self._attention_mask = None, None
        return value

    def _record(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.value is None or trial_running():
            # A local-execution trial of a module holding this router runs it on random stand-ins:
            # its logits are no layer's, and its graph is freed by the trial's own backward.
            return
        logits = output[self._logits_index] if isinstance(output, (tuple, list)) else output
        layer = load_balancing_statistics([logits], self.num_experts, self.top_k, self._attention_mask)
        self.value = self.value + layer.to(self.value.device)


def router_statistics_of(model: nn.Module) -> RouterStatistics | None:
    """The :class:`RouterStatistics` recorded for ``model``, if any.

    Example::

        statistics = router_statistics_of(model)   # None: the load-balancing loss is not made global
    """
    return getattr(model, ROUTER_STATISTICS_ATTRIBUTE, None)


def record_router_statistics(model: nn.Module, num_experts: int, top_k: int) -> RouterStatistics:
    """Hook ``model``'s routers to record their statistics stage by stage (idempotent).

    Example::

        statistics = record_router_statistics(model, model.num_experts, model.num_experts_per_tok)
    """
    statistics = router_statistics_of(model)
    if statistics is None:
        statistics = RouterStatistics(model, num_experts, top_k)
        setattr(model, ROUTER_STATISTICS_ATTRIBUTE, statistics)
    return statistics
