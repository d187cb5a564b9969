"""Overlap shown, not claimed: the first bucket's reduction starts before backward ends.

``vescale.dtensor.comm.CommCounter`` stamps every collective with the time it was issued.
The model is a stack of Linear layers in buckets of about one layer each; backward
produces the last layer's gradients first, so the first bucket fills long before the first
layer's weight, the last gradient of the pass, arrives. A hook registered on that weight
before DDP's stamps the arrival. With ``overlap=True`` the first bucket's collective
must have been issued, during backward, before that stamp; with ``overlap=False`` (every
reduction launched when backward ends) it must come after it, which shows that the
comparison can tell the two apart.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from vescale.doptim import DDP
from vescale.doptim.reduction import ALL_REDUCE_SCATTER_BACKENDS
from vescale.dtensor import init_mesh
from vescale.dtensor.comm import BACKWARD, CommCounter
from vescale.dtensor.testing import run_on_ranks

WIDTH = 128
LAYERS = 6
# A little more than one layer's weight and bias in fp32: one bucket per layer.
BUCKET_MB = (WIDTH * WIDTH + WIDTH) * 4 * 1.5 / 2**20


def reduction_and_last_gradient_times(zero_stage: int, overlap: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    first_weight = model[0].weight
    last_gradient_ns: list[int] = []
    # Registered before DDP's hook, so it runs first: the moment the pass's last gradient arrives.
    first_weight.register_post_accumulate_grad_hook(lambda _: last_gradient_ns.append(time.perf_counter_ns()))
    mesh = init_mesh(dp=dist.get_world_size())
    ddp = DDP(model, mesh, bucket_size_mb=BUCKET_MB, overlap=overlap, zero_stage=zero_stage)
    inputs = torch.randn(64, WIDTH)
    with CommCounter(mesh) as counter:
        model(inputs).square().mean().backward()
    reductions = [call for call in counter.calls if call.mesh_dim == "dp"]
    return {
        "buckets": len(ddp.buckets),
        "reductions": len(reductions),
        "collective": reductions[0].collective,
        "backend": dist.get_backend(),
        "phase": reductions[0].phase,
        "first_reduction_issued_ns": reductions[0].issued_ns,
        "last_gradient_ns": last_gradient_ns[0],
    }


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_first_bucket_reduction_starts_before_the_last_gradient_arrives(zero_stage):
    for times in run_on_ranks(reduction_and_last_gradient_times, world_size=2, args=(zero_stage, True)):
        assert times["buckets"] == LAYERS and times["reductions"] == LAYERS
        # ZeRO-2 reduce-scatters, except where the backend's reduce-scatter all-reduces a copy (gloo).
        scatters = zero_stage == 2 and times["backend"] not in ALL_REDUCE_SCATTER_BACKENDS
        assert times["collective"] == ("reduce_scatter" if scatters else "all_reduce")
        assert times["phase"] == BACKWARD
        lead_ms = (times["last_gradient_ns"] - times["first_reduction_issued_ns"]) / 1e6
        print(f"zero={zero_stage}: first bucket's reduction issued {lead_ms:.3f} ms before the last gradient")
        assert times["first_reduction_issued_ns"] < times["last_gradient_ns"]


def test_without_overlap_the_first_reduction_starts_after_the_last_gradient():
    for times in run_on_ranks(reduction_and_last_gradient_times, world_size=2, args=(0, False)):
        assert times["first_reduction_issued_ns"] > times["last_gradient_ns"]
