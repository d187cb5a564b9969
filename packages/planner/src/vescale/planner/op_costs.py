"""What each op of a meta-tensor forward costs: matmul FLOPs and shapes, attention FLOPs, and the
bytes every other op reads and writes.

:func:`~vescale.planner.profile.profile_model` runs :class:`OpCostRecorder` under its forward,
so every record knows its module and repeated block; :mod:`vescale.planner.cost` turns the
records into seconds. Views and in-place ops move no new data and are not counted as memory
traffic (they still count as one eager op each); attention is recorded once, as the fused
kernel a real device runs, with half the score FLOPs when it is causal.

Example::

    profile = profile_model(model, sequence_length=2048)
    sum(op.flops for op in profile.op_costs if op.kind == "matmul")   # forward matmul FLOPs
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCost", "OpCostRecorder", "attention_cost"]

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


@dataclass(frozen=True)
class OpCost:
    """One forward op: ``kind`` is ``"matmul"``, ``"attention"`` or ``"memory"``; bytes as on meta (fp32).

    ``dims`` are a matmul's ``(m, n, k)`` (attention: ``(query rows, key rows, head dim)``);
    ``output_bytes`` is what a row-parallel matmul's all-reduce would move.
    """

    kind: str
    module_fqn: str
    block: int | None
    side: str
    flops: float
    dims: tuple[int, int, int]
    traffic_bytes: float
    output_bytes: float


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def attention_cost(
    query: torch.Tensor, key: torch.Tensor, causal: bool
) -> tuple[float, tuple[int, int, int]]:
    """Forward FLOPs and ``(query rows, key rows, head dim)`` of one fused attention call.

    Example::

        attention_cost(torch.empty(1, 8, 128, 64), torch.empty(1, 8, 128, 64), causal=True)[0]
    """
    batch_heads = query.numel() // (query.shape[-1] * query.shape[-2])
    rows, keys, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    flops = 4.0 * batch_heads * rows * keys * head_dim * (0.5 if causal else 1.0)
    return flops, (rows, keys, head_dim)


class OpCostRecorder(TorchDispatchMode):
    """Record an :class:`OpCost` per op through ``record(kind, flops, dims, traffic, output_bytes)``;
    ops inside attention (``inside()`` true) are left to the attention's own record."""

    def __init__(self, record: Callable[..., None], inside: Callable[[], bool]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.record, self.inside = record, inside

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if self.inside():
            return output
        if func in _MATMULS or func is _aten._grouped_mm.default:
            self._matmul(func, args, output)
            return output
        inputs = [arg for arg in args if isinstance(arg, torch.Tensor)]
        outputs = [output] if isinstance(output, torch.Tensor) else []
        if isinstance(output, list | tuple):
            outputs = [item for item in output if isinstance(item, torch.Tensor)]
        storages = {id(tensor.untyped_storage()) for tensor in inputs if tensor.device.type == "meta"}
        fresh = [tensor for tensor in outputs if id(tensor.untyped_storage()) not in storages]
        traffic = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in fresh) if fresh else 0
        self.record("memory", 0.0, (0, 0, 0), float(traffic), 0.0)
        return output

    def _matmul(self, func: Any, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if func in (_aten.addmm.default, _aten.baddbmm.default):
            first, second = args[1], args[2]
        else:
            first, second = args[0], args[1]
        m = first.numel() // first.shape[-1]
        k = first.shape[-1]
        n = second.shape[-1]
        if func is _aten._grouped_mm.default:
            m = first.shape[-2] if first.ndim == 3 else first.shape[0]
        flops = 2.0 * m * n * k
        traffic = _nbytes(first) + _nbytes(second) + _nbytes(output)
        self.record("matmul", flops, (m, n, k), float(traffic), float(_nbytes(output)))
