"""Token dispatch and combine over the expert-parallel group: all-to-all with variable splits.

Each rank routes its own tokens (its router ran locally). With E experts over an ep group of
P ranks, rank p owns experts ``p·E/P .. (p+1)·E/P − 1``. One step:

1. the (token, k) pairs are sorted by expert (stable: token order within an expert), so
   they are grouped by owning rank; the per-expert counts are exchanged (one all-to-all of
   E integers), which gives every rank its send and receive split sizes;
2. **dispatch**: the pairs' hidden states go to their experts' owners (all-to-all with
   variable splits); the receiver regroups the rows from (source rank, expert) order to
   (expert, source rank) order and runs its local experts on them;
3. **combine**: the expert outputs go back the same way (the transposed all-to-all) and
   each token sums its k outputs times its router weights, in its original order.

Backward runs the two all-to-alls transposed. Every rank issues the same collectives
whatever its routing (a rank that sends or receives nothing sends empty splits), so an
expert, or a whole rank, that receives no token never hangs a collective, and its
parameters still get a zero gradient (they stay in the graph through an empty matmul).

**Capacity** (``capacity_factor``, default ``None``: dropless): each source rank keeps at
most ``ceil(capacity_factor · tokens · k / E)`` pairs per expert, the first ones in token
order, and drops the rest (their output is zero); the count dropped is returned.

**Passes without data** (fake or meta tensors: dpipe's trace, which finds the module order
and FLOPs before a pipeline split) exchange nothing: routing is data-dependent, so the pass
stands for a balanced step instead, each rank's experts computing as many rows as its
tokens send (tokens·k, spread evenly over its local experts), and combining them locally.

The all-to-alls are labelled with :func:`vescale.dtensor.comm.comm_scope`
(``<scope>/counts``, ``<scope>/dispatch``, ``<scope>/combine``) so a
:class:`~vescale.dtensor.comm.CommCounter` sums them per module.

Example::

    out, dropped = dispatch_and_combine(hidden, top_k_index, top_k_weights, local_experts,
                                        num_experts=8, group=mesh.get_group("ep"))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vescale.dtensor.comm import comm_scope
from vescale.dtensor.grouped_mm_shapes import holds_no_data

__all__ = ["RoutePlan", "all_to_all", "dispatch_and_combine", "plan_routes"]

LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows with variable splits; its backward is the transposed all-to-all."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: Any,
        scope: str,
    ) -> torch.Tensor:
        ctx.group, ctx.scope = group, scope
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        received = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        with comm_scope(scope):
            dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad_received: torch.Tensor) -> tuple[Any, ...]:
        grad_rows = grad_received.new_empty((sum(ctx.input_splits), *grad_received.shape[1:]))
        with comm_scope(ctx.scope):
            dist.all_to_all_single(
                grad_rows, grad_received.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group
            )
        return grad_rows, None, None, None, None


def all_to_all(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any, scope: str
) -> torch.Tensor:
    """Differentiable all-to-all of ``rows`` (dim 0) with variable splits over ``group``.

    Example::

        received = all_to_all(tokens, [3, 1], [2, 2], mesh.get_group("ep"), "experts/dispatch")
    """
    # torch leaves Function.apply unannotated.
    received: torch.Tensor = _AllToAll.apply(  # type: ignore[no-untyped-call]
        rows, output_splits, input_splits, group, scope
    )
    return received


@dataclass(frozen=True)
class RoutePlan:
    """Where this rank's (token, k) pairs go and what it receives, for one MoE forward.

    ``order``: the kept pairs' flat indices (``token·k + slot``), sorted by expert;
    ``input_splits``/``output_splits``: rows sent to / received from each ep rank;
    ``regroup``: received row indices in (local expert, source rank) order;
    ``local_counts``: rows per local expert (a tensor, length E/ep); ``dropped``: pairs dropped.
    """

    order: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    regroup: torch.Tensor
    local_counts: torch.Tensor
    dropped: int


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


def plan_routes(
    top_k_index: torch.Tensor,
    num_experts: int,
    group: Any,
    *,
    capacity_factor: float | None = None,
    scope: str = "experts",
) -> RoutePlan:
    """The :class:`RoutePlan` of ``top_k_index`` (tokens, k); exchanges the per-expert counts.

    Example::

        plan = plan_routes(top_k_index, 8, mesh.get_group("ep"))
        plan.input_splits   # e.g. [5, 3, 4, 4]: pairs sent to each ep rank
    """
    ep_size = dist.get_world_size(group)
    local_experts = num_experts // ep_size
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    dropped = 0
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * flat.numel() / num_experts)
        position = torch.arange(flat.numel(), device=flat.device) - _exclusive_cumsum(counts)[flat[order]]
        keep = position < capacity
        dropped = int(flat.numel() - keep.sum().item())
        order = order[keep]
        counts = counts.clamp(max=capacity)
    received_counts = torch.empty_like(counts)
    with torch.no_grad(), comm_scope(f"{scope}/counts"):
        dist.all_to_all_single(received_counts, counts, group=group)
    counts_by_rank = counts.view(ep_size, local_experts)
    received_by_rank = received_counts.view(ep_size, local_experts)
    input_splits = counts_by_rank.sum(1).tolist()
    output_splits = received_by_rank.sum(1).tolist()
    # Received rows come in (source rank, local expert) blocks; the experts want them expert-major.
    block_starts = _exclusive_cumsum(received_by_rank.reshape(-1)).view(ep_size, local_experts)
    lengths = received_by_rank.t().reshape(-1)
    starts = block_starts.t().reshape(-1)
    total = sum(output_splits)
    regroup = torch.repeat_interleave(starts - _exclusive_cumsum(lengths), lengths, output_size=total)
    regroup = regroup + torch.arange(total, device=regroup.device)
    return RoutePlan(order, input_splits, output_splits, regroup, received_by_rank.sum(0), dropped)


def _balanced_without_data(
    hidden_states: torch.Tensor,
    top_k_weights: torch.Tensor,
    local_experts: LocalExperts,
    num_experts: int,
    group: Any,
) -> torch.Tensor:
    """The shapes and FLOPs of a balanced step on tensors without data; no collective is issued."""
    num_tokens, top_k = top_k_weights.shape
    local_count = num_experts // dist.get_world_size(group)
    rows = num_tokens * top_k
    counts = [rows // local_count + (index < rows % local_count) for index in range(local_count)]
    pairs = hidden_states.repeat_interleave(top_k, dim=0)
    outputs = local_experts(pairs, torch.tensor(counts, device=pairs.device))
    weighted = outputs.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(outputs.dtype)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def dispatch_and_combine(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    local_experts: LocalExperts,
    *,
    num_experts: int,
    group: Any,
    capacity_factor: float | None = None,
    scope: str = "experts",
) -> tuple[torch.Tensor, int]:
    """Run an MoE experts layer over the ep group: ``(output (tokens, hidden), pairs dropped)``.

    ``local_experts(rows, counts)`` computes this rank's experts on ``rows`` grouped by local
    expert (``counts[j]`` rows for local expert j) and returns one output row per input row.

    Example::

        out, dropped = dispatch_and_combine(hidden, index, weights, experts_fn,
                                            num_experts=8, group=ep_group, scope="layers.1.mlp.experts")
    """
    num_tokens, top_k = top_k_index.shape
    if holds_no_data(hidden_states):
        return _balanced_without_data(hidden_states, top_k_weights, local_experts, num_experts, group), 0
    plan = plan_routes(top_k_index, num_experts, group, capacity_factor=capacity_factor, scope=scope)
    sent = hidden_states[plan.order // top_k]
    received = all_to_all(sent, plan.output_splits, plan.input_splits, group, f"{scope}/dispatch")
    expert_outputs = local_experts(received[plan.regroup], plan.local_counts)
    back_to_source_order = torch.empty_like(plan.regroup)
    back_to_source_order[plan.regroup] = torch.arange(plan.regroup.numel(), device=plan.regroup.device)
    returned = all_to_all(
        expert_outputs[back_to_source_order], plan.input_splits, plan.output_splits, group, f"{scope}/combine"
    )
    weighted = returned * top_k_weights.reshape(-1)[plan.order].unsqueeze(-1)
    per_pair = weighted.new_zeros(num_tokens * top_k, weighted.shape[-1]).index_copy(0, plan.order, weighted)
    combined = per_pair.view(num_tokens, top_k, -1).sum(dim=1)
    return combined.to(hidden_states.dtype), plan.dropped
