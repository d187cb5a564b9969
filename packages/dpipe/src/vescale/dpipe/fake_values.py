"""Answer the values model code reads during dpipe's fake-tensor forward, as a training batch would.

Splitting needs the order in which modules run, not values; but model code reads values as
it goes (XLM asserts ``lengths.max().item() <= slen``, a mixture-of-experts layer finds each
expert's tokens with ``nonzero``), which fake tensors cannot answer. Under
:class:`FakeValuePolicy` an ``all()`` reads true and an ``any()`` false (no padding, no
packing, no overflow), any other scalar read is 0, and ``nonzero`` finds one hit, so every
branch after it runs. The answers only steer the fake pass: the stages run on real values,
and a stage that does not reach its boundary with them raises ``PipelineCutError``.

Example::

    with _compat.fake_tensor_mode(), FakeValuePolicy():
        trace = model(**fake_batch)
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FakeValuePolicy"]

_aten = torch.ops.aten
_ALL_OPS = (_aten.all.default, _aten.all.dim, _aten.all.dims)
_ANY_OPS = (_aten.any.default, _aten.any.dim, _aten.any.dims)
_SCALAR_READS = (_aten._local_scalar_dense.default, _aten.is_nonzero.default)


class FakeValuePolicy(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    """Data-dependent reads of fake tensors answered as an ordinary training batch would (module docstring).

    Example::

        with _compat.fake_tensor_mode(), FakeValuePolicy():
            assert bool((torch.zeros(2) == 0).all())
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        # id() of each all()/any() result -> its answer; the results are kept alive for the pass.
        self.known: dict[int, bool] = {}
        self._answered: list[torch.Tensor] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # Tried first: a real tensor answers for itself; a DTensor reaches its fake shards only here.
        if func in _SCALAR_READS:
            try:
                return func(*args, **kwargs)
            except DataDependentOutputException:
                value = self.known.get(id(args[0]), 0)
                return bool(value) if func is _aten.is_nonzero.default else value
        if func is _aten.nonzero.default:
            try:
                return func(*args, **kwargs)
            except DynamicOutputShapeException:
                return torch.zeros((1, args[0].ndim), dtype=torch.long, device=args[0].device)
        output = func(*args, **kwargs)
        if func in _ALL_OPS or func in _ANY_OPS:
            self.known[id(output)] = func in _ALL_OPS
            self._answered.append(output)
        return output
