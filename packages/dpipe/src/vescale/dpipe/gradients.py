"""The gradients a pipeline schedule leaves behind, made into the whole batch's gradients.

Each micro-batch's backward starts from its share of the batch's mean loss (its loss divided
by the micro-batch count), so the schedule's accumulation adds up the batch's gradient and
nothing divides after it: gradients that a loop accumulated over earlier calls stay as they were
(a division after the schedule divided them again). PyTorch's zero-bubble schedules write weight
gradients with ``param.grad += dw`` outside autograd, so the post-accumulate-grad hooks that
data parallelism (``vescale.doptim``'s DDP buckets) and tensor parallelism (dmodule's grad sync
of ``Partial`` gradients) rely on see only some of them. After the schedule, this module sums
tied parameters (GPT-2's ``wte``/``lm_head``) over the pipeline stages that hold them (taking
back first the gradients DDP holds in its buckets: a parameter of another dtype than the
buckets'), then hands every gradient to autograd once more (``torch.autograd.backward`` on the
parameters themselves), so that each of those hooks sees each parameter's final gradient
exactly once, whatever the schedule. Data-parallel averaging is held back during the
schedule (DDP's ``no_sync``) and happens in that last pass: once per step, not once per
micro-batch (ZeRO-2 keeps only the last reduce-scatter of a step, so it must be once).

Example::

    with data_parallel_sync_deferred(pipe):
        schedule.step(**batch)
    finish_pipeline_gradients(model.parameters(), tied, local_stages=[0], pp_group=group, device=device)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vescale.doptim import data_parallel_of
from vescale.dpipe.dtensor_boundary import local_tensor
from vescale.dpipe.split import StageLayout

__all__ = [
    "TiedParameter",
    "data_parallel_sync_deferred",
    "finish_pipeline_gradients",
    "tied_gradients_counted_once",
    "tied_parameters",
]


@dataclass(frozen=True)
class TiedParameter:
    """A parameter that more than one stage holds, and what a rank without it contributes."""

    fqn: str
    stages: frozenset[int]
    parameter: nn.Parameter
    # The local (tp shard) shape: a rank that holds no copy adds zeros shaped like its pp peers'.
    local_shape: tuple[int, ...]
    dtype: torch.dtype


def tied_parameters(model: nn.Module, layout: StageLayout) -> list[TiedParameter]:
    """The parameters of ``model`` that units of more than one stage of ``layout`` hold.

    Example::

        tied = tied_parameters(gpt2, layout)
        assert [p.fqn for p in tied] == ["transformer.wte.weight"]
    """
    owners: dict[int, tuple[str, set[int], nn.Parameter]] = {}
    for unit_fqn, stage_index in layout.unit_stage.items():
        for name, parameter in model.get_submodule(unit_fqn).named_parameters(remove_duplicate=False):
            owners.setdefault(id(parameter), (f"{unit_fqn}.{name}", set(), parameter))[1].add(stage_index)
    return [
        TiedParameter(fqn, frozenset(stages), param, tuple(local_tensor(param).shape), param.dtype)
        for fqn, stages, param in owners.values()
        if len(stages) > 1
    ]


@contextlib.contextmanager
def data_parallel_sync_deferred(module: nn.Module) -> Iterator[None]:
    """Inside, a data-parallel ``module`` (``vescale.doptim`` DDP/ZeRO-1/2) accumulates without averaging.

    Example::

        with data_parallel_sync_deferred(pipe):
            schedule.step(**batch)
    """
    data_parallel = data_parallel_of(module)
    # ZeRO-3 (FSDP2) has no no_sync here; it is not supported under a pipeline (see README).
    no_sync = getattr(data_parallel, "no_sync", None)
    with no_sync() if no_sync is not None else contextlib.nullcontext():
        yield


def tied_gradients_counted_once(tied: list[TiedParameter], *, local_stages: list[int]) -> None:
    """Before a call's schedule: keep the gradient a loop accumulated over earlier calls in one
    copy of each tied parameter (the one of its first stage) and zero the other copies, so the
    sum over the pipeline after the schedule counts it once and adds this call's contributions.

    Example::

        tied_gradients_counted_once(tied, local_stages=[1])
        schedule.step(**batch)
        finish_pipeline_gradients(model.parameters(), tied, local_stages=[1], pp_group=group, device=device)
    """
    for tied_parameter in tied:
        held = tied_parameter.stages.intersection(local_stages)
        if not held or min(tied_parameter.stages) in held:
            continue
        parameter = tied_parameter.parameter
        if parameter.grad is not None:
            parameter.grad.zero_()
            continue
        # DDP holds the earlier calls' gradient of a parameter not of its buckets' dtype: dropping
        # what it hands back empties the bucket's range (its next hook copies instead of adding).
        take = getattr(data_parallel_of(parameter), "take_accumulated_gradient", None)
        if take is not None:
            take(parameter)


def finish_pipeline_gradients(
    parameters: Iterable[nn.Parameter],
    tied: list[TiedParameter],
    *,
    local_stages: list[int],
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Sum tied copies over ``pp_group`` and re-deliver the gradients through autograd.

    ``parameters`` are this rank's (each once). Call it on every pp rank (the tied sum is a
    collective) after the schedule ran its backward passes.

    Example::

        finish_pipeline_gradients(model.parameters(), tied, local_stages=[0],
                                  pp_group=mesh.get_group("pp"), device=torch.device("cpu"))
    """
    parameters = list(parameters)
    for parameter in parameters:
        if parameter.grad is None:
            # DDP moved the gradient of a parameter of another dtype than its buckets' (a bf16 or
            # float64 model) into a bucket: take it back for the tied sum and the re-delivery.
            data_parallel = data_parallel_of(parameter)
            take = getattr(data_parallel, "take_accumulated_gradient", None)
            parameter.grad = take(parameter) if take is not None else None
    for tied_parameter in tied:
        parameter = tied_parameter.parameter
        if not tied_parameter.stages.intersection(local_stages):
            summed = torch.zeros(tied_parameter.local_shape, dtype=tied_parameter.dtype, device=device)
        else:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            # A tensor-parallel copy: the pp peers hold the same tp shard, so sum local shards.
            summed = local_tensor(parameter.grad)
        # Ranks without the parameter add zeros, which keeps the sum exact and the call collective.
        dist.all_reduce(summed, group=pp_group)
    with_gradient = [parameter for parameter in parameters if parameter.grad is not None]
    if not with_gradient:
        return
    gradients = [parameter.grad for parameter in with_gradient]
    for parameter in with_gradient:
        parameter.grad = None
    # Autograd accumulates each gradient into its (now empty) .grad unchanged and runs the
    # parameters' post-accumulate-grad hooks, then the end-of-backward callbacks (DDP's average).
    torch.autograd.backward(with_gradient, gradients)
