"""ZeRO-2 reduces a one-parameter bucket's gradient in place: the tensor autograd produced is the
bucket, with no second full-size buffer and no copy, and the step still applies the global
batch's gradient.

Every parameter gets a bucket of its own (1-byte buckets). A hook registered before DDP's records
the gradient autograd handed over; one registered after it records the bucket's buffer. Where
the bucket is the gradient whole they must be the same storage; where the bucket is padded to a
multiple of dp (3 elements over 2 ranks) they must not be. Then
one plain SGD step on each rank's slice of the batch, with gradient accumulation over two
micro-batches in a second run (the second micro-batch adds into the adopted buffer in place),
must apply the gradient a single process computes on the whole batch: measured 6e-8 relative
at worst; a gradient off by a factor of dp errs by 0.5 or more.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from vescale.doptim import DistributedOptimizer, data_parallel, data_parallel_of
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import assert_close_by_fqn, full_parameters, sgd_step_gradients

GLOBAL_BATCH = 8
SGD_LR = 1e3
GRAD_RTOL = 1e-5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(
        GLOBAL_BATCH, 3, generator=generator
    )


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(inputs), targets)


def reference_gradients() -> dict[str, torch.Tensor]:
    model = _model()
    _loss(model, *_batch()).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def zero2_step(micro_batches: int) -> tuple[dict[str, bool], dict[str, torch.Tensor]]:
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    handed_over: dict[str, int] = {}
    in_bucket: dict[str, bool] = {}
    names = {id(param): name for name, param in model.named_parameters()}

    def before_ddp(param: torch.Tensor) -> None:
        # Registered before DDP's hook: the gradient as autograd accumulated it.
        handed_over.setdefault(names[id(param)], param.grad.untyped_storage().data_ptr())

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(before_ddp)
    # overlap=False: every bucket is reduced when backward ends, so the hook after DDP's finds it
    # still there (overlapping, a small bucket's reduction can complete, and free it, at once).
    data_parallel(model, init_mesh(dp=dp), zero_stage=2, bucket_size_mb=1 / 2**20, overlap=False)
    ddp = data_parallel_of(model)
    slot_bucket = {slot.fqn: bucket for bucket, slot in ddp.slots()}

    def after_ddp(param: torch.Tensor) -> None:
        name = names[id(param)]
        buffer = slot_bucket[name].grad_buffer
        if buffer is not None and name not in in_bucket:
            in_bucket[name] = buffer.untyped_storage().data_ptr() == handed_over[name]

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(after_ddp)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=SGD_LR))
    inputs, targets = _batch()
    rows = GLOBAL_BATCH // dp
    local_inputs, local_targets = (
        inputs[rank * rows : (rank + 1) * rows],
        targets[rank * rows : (rank + 1) * rows],
    )
    before = full_parameters(model)
    micro_rows = rows // micro_batches
    for index in range(micro_batches):
        part = slice(index * micro_rows, (index + 1) * micro_rows)
        with ddp.no_sync() if index < micro_batches - 1 else contextlib.nullcontext():
            (_loss(model, local_inputs[part], local_targets[part]) / micro_batches).backward()
    optimizer.step()
    return in_bucket, sgd_step_gradients(before, full_parameters(model), SGD_LR)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("dp_size", [2, 4])
def test_a_whole_bucket_is_the_gradient_itself_and_the_step_matches(dp_size, micro_batches):
    reference = reference_gradients()
    # Padded to a multiple of dp: 2.bias (3 elements) on 2 and 4 ranks, 0.bias (6) and 2.weight (18) on 4.
    padded = {"2.bias"} if dp_size == 2 else {"0.bias", "2.weight", "2.bias"}
    for in_bucket, gradients in run_on_ranks(zero2_step, world_size=dp_size, args=(micro_batches,)):
        assert set(in_bucket) == set(reference)
        assert {name for name, same in in_bucket.items() if not same} == padded, in_bucket
        worst = assert_close_by_fqn(gradients, reference, GRAD_RTOL, f"dp={dp_size} micro={micro_batches}")
        print(f"dp={dp_size} micro_batches={micro_batches}: first-step gradients {worst:.2e}")
