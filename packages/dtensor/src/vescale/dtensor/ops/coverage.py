"""Which aten ops reach DTensor in a run, and which of them DTensor can shard.

:class:`OpCoverageRecorder` is a ``TorchDispatchMode``: modes see every op before tensor
subclasses do, after autograd, so it sees exactly the ops (forward and backward) that
DTensor's dispatcher receives. It records each op that has a DTensor argument and checks
DTensor's registries for a sharding strategy. With ``replicate_uncovered=True`` an op
without a strategy is computed on full (all-gathered) tensors and returned as Replicate,
so one traced step lists every missing op instead of stopping at the first.

Example::

    with OpCoverageRecorder() as recorder:
        model(input_ids, labels=labels).loss.backward()
    print(recorder.report().format_table())
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from vescale.dtensor import _compat

__all__ = ["OpCoverageRecorder", "OpCoverageReport", "has_sharding_strategy", "op_name"]


def op_name(op: Any) -> str:
    """``aten.mm.default`` for ``torch.ops.aten.mm.default``.

    Example::

        assert op_name(torch.ops.aten.mm.default) == "aten.mm.default"
    """
    return str(op)


def has_sharding_strategy(op: Any) -> bool:
    """Whether DTensor has a strategy, rule or custom handler for ``op``.

    Example::

        import vescale.dtensor.ops  # registers veScale's strategies
        assert has_sharding_strategy(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    """
    return any(op in registry for registry in _compat.dtensor_strategy_registries().values())


@dataclass
class OpCoverageReport:
    """Ops seen with their call counts, and which of them lack a sharding strategy.

    Example::

        report = recorder.report()
        assert report.coverage_percent == 100.0, report.uncovered
    """

    op_counts: dict[str, int] = field(default_factory=dict)
    uncovered: list[str] = field(default_factory=list)

    @property
    def covered(self) -> list[str]:
        return [name for name in self.op_counts if name not in self.uncovered]

    @property
    def coverage_percent(self) -> float:
        if not self.op_counts:
            return 100.0
        return 100.0 * len(self.covered) / len(self.op_counts)

    def format_table(self) -> str:
        """One line per op (``covered``/``MISSING``, call count), then the totals."""
        width = max((len(name) for name in self.op_counts), default=10)
        lines = [f"{'op':<{width}}  {'strategy':<8}  calls"]
        for name in sorted(self.op_counts):
            status = "MISSING" if name in self.uncovered else "covered"
            lines.append(f"{name:<{width}}  {status:<8}  {self.op_counts[name]}")
        lines.append(
            f"ops seen: {len(self.op_counts)}, covered: {len(self.covered)}, "
            f"coverage: {self.coverage_percent:.1f}%"
        )
        return "\n".join(lines)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _flatten(item)]
    return [value]


def _map_tensors(value: Any, function: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, function) for item in value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, function) for key, item in value.items()}
    return value


if TYPE_CHECKING:
    from vescale.dtensor._compat import TorchDispatchMode as _DispatchModeBase
else:
    _DispatchModeBase = _compat.torch_dispatch_mode_class()


class OpCoverageRecorder(_DispatchModeBase):
    """Record the aten ops that reach DTensor while active (see the module docstring).

    Example::

        with OpCoverageRecorder(replicate_uncovered=True) as recorder:
            loss = model(input_ids).sum(); loss.backward()
        assert not recorder.report().uncovered
    """

    def __init__(self, replicate_uncovered: bool = False) -> None:
        super().__init__()
        self.replicate_uncovered = replicate_uncovered
        self._op_counts: Counter[str] = Counter()
        self._uncovered: dict[str, None] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        dtensor_args = [arg for arg in _flatten((args, kwargs)) if isinstance(arg, DTensor)]
        if not dtensor_args:
            return func(*args, **kwargs)
        name = op_name(func)
        self._op_counts[name] += 1
        if has_sharding_strategy(func):
            return func(*args, **kwargs)
        self._uncovered[name] = None
        if not self.replicate_uncovered:
            return func(*args, **kwargs)
        mesh = dtensor_args[0].device_mesh
        replicate = [Replicate()] * mesh.ndim
        full_args, full_kwargs = _map_tensors(
            (args, kwargs), lambda tensor: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        )
        result = func(*full_args, **full_kwargs)
        return _map_tensors(
            result, lambda tensor: DTensor.from_local(tensor, mesh, replicate, run_check=False)
        )

    def report(self) -> OpCoverageReport:
        """The ops recorded so far."""
        return OpCoverageReport(op_counts=dict(self._op_counts), uncovered=list(self._uncovered))
