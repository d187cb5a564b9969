"""DTensorOpLogger on a tensor-parallel MLP on real gloo ranks.

The op records are compared with the ops PyTorch's ColwiseParallel/RowwiseParallel linear
layers run (``aten.t`` + ``aten.addmm`` with the weight's placements). The model output
under the logger is compared with the single-process model (same seed, same input) to a
few float32 ulps: a shard's matmul is over a narrower matrix than the reference's, so BLAS
may round the same dot products in another order.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vescale.dtensor.comm import BACKWARD, FORWARD, CommCounter
from vescale.dtensor.debug import DTensorOpLogger, log_dtensor_ops
from vescale.dtensor.mesh import init_mesh
from vescale.dtensor.testing import run_on_ranks

LINEAR_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(hidden)))


def _model_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("mlp", TinyMLP())
    return model, torch.randn(4, 8)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# --- functions that run on the ranks (module level: ranks look them up by name) ---


def _hook_count(model: nn.Module) -> int:
    return sum(len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules())


def logged_tp_mlp_on_ranks(mesh_shape: tuple[int, ...]) -> dict:
    mesh = (
        init_mesh(tp=mesh_shape[0]) if len(mesh_shape) == 1 else init_mesh(dp=mesh_shape[0], tp=mesh_shape[1])
    )
    model, hidden = _model_and_input()
    parallelize_module(model, mesh["tp"], {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    hooks_before = _hook_count(model)
    handler = _ListHandler()
    package_logger = logging.getLogger("vescale.dtensor")
    package_logger.addHandler(handler)
    previous_level = package_logger.level
    package_logger.setLevel(logging.INFO)
    try:
        with CommCounter(mesh) as counter, log_dtensor_ops(model) as op_logger:
            outside = distribute_tensor(torch.ones(2), mesh["tp"], [Replicate()]) * 2
            output = model(hidden)
            output.sum().backward()
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(previous_level)
    return {
        "records": [
            (r.phase, r.module_fqn, r.op, r.input_placements, r.output_placements) for r in op_logger.records
        ],
        "messages": handler.messages,
        "record_strings": [str(r) for r in op_logger.records],
        "output": output.detach(),
        "outside": outside.to_local(),
        "hooks_added_and_left": _hook_count(model) - hooks_before,
        "collectives": [(call.collective, call.phase) for call in counter.calls],
    }


def debug_level_is_silent_at_info_on_ranks() -> tuple[int, int]:
    mesh = init_mesh(tp=2)
    handler = _ListHandler()
    package_logger = logging.getLogger("vescale.dtensor")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        with DTensorOpLogger() as op_logger:
            distribute_tensor(torch.ones(2), mesh, [Replicate()]) * 2
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(logging.NOTSET)
    return len(op_logger.records), len(handler.messages)


# --- tests (run in the pytest process) ---


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_logger_records_placements_and_module_of_each_dtensor_op(mesh_shape):
    model, hidden = _model_and_input()
    reference = model(hidden).detach()
    world_size = int(torch.tensor(mesh_shape).prod())
    for result in run_on_ranks(logged_tp_mlp_on_ranks, world_size, args=(mesh_shape,)):
        records = result["records"]
        forward = [r for r in records if r[0] == FORWARD]
        assert forward == [
            (FORWARD, "", "aten.mul.Tensor", (("R",),), (("R",),)),
            (FORWARD, "mlp.fc1", "aten.t.default", (("S(0)",),), (("S(1)",),)),
            (FORWARD, "mlp.fc1", "aten.addmm.default", (("S(0)",), ("R",), ("S(1)",)), (("S(1)",),)),
            (FORWARD, "mlp.fc2", "aten.t.default", (("S(1)",),), (("S(0)",),)),
            (FORWARD, "mlp.fc2", "aten.addmm.default", (("R",), ("S(1)",), ("S(0)",)), (("P",),)),
        ]
        backward_modules = [r[1] for r in records if r[0] == BACKWARD]
        # Backward runs fc2's nodes, then fc1's: each op is attributed to the module that made its node.
        first_fc1 = backward_modules.index("mlp.fc1")
        assert set(backward_modules[:first_fc1]) == {"mlp.fc2"}
        assert set(backward_modules[first_fc1:]) == {"mlp.fc1"}
        assert (BACKWARD, "mlp.fc1", "aten.mm.default", (("S(0)",), ("R",)), (("S(0)",),)) in records
        assert result["messages"] == result["record_strings"]
        assert result["record_strings"][0] == "forward <root> aten.mul.Tensor: [R] -> [R]"
        assert torch.equal(result["outside"], torch.full((2,), 2.0))
        torch.testing.assert_close(result["output"], reference, **LINEAR_TOLERANCE)
        assert result["hooks_added_and_left"] == 0
        # Entered inside the counter, the logger hides no collective: distribute_tensor's
        # broadcast of the Replicate tensor, and the all-reduce of fc2's Partial output.
        assert result["collectives"] == [("broadcast", FORWARD), ("all_reduce", FORWARD)]


def test_default_level_is_debug_and_records_are_kept_without_logging():
    assert run_on_ranks(debug_level_is_silent_at_info_on_ranks, world_size=2) == [(1, 0), (1, 0)]
