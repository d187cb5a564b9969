"""``view`` and ``_unsafe_view`` that unflatten an unevenly sharded dim by redistributing it.

PyTorch marks its view strategies strict: when a view splits a sharded dim into parts that
do not divide by the mesh (a ``Shard(0)`` over 16 tokens viewed as ``(2, 8)`` on 4 ranks),
it raises "Cannot unflatten unevenly sharded tensor", where its ``view_copy`` strategy
redistributes that mesh dim to Replicate first. Autograd and ``transformers`` emit such
views where a user cannot step in (the backward of ``x.view(-1, hidden)`` in an MoE block,
``_unsafe_view`` from a reshape), so for this one failure the copying twin's strategy is
used; the result then no longer aliases the input. Every other case, flattening an uneven
shard included, keeps PyTorch's strict behaviour. The wrapper only runs when DTensor
propagates a new op schema (results are cached), so it costs nothing per call. torch 2.11
has no ``view_copy`` strategy: there the strict behaviour stays.

Example::

    import vescale.dtensor.ops  # installs the wrapper
    tokens = grad_tokens_shard0.view(2, 8, 32)   # 16 tokens on 4 ranks: gathered, then viewed
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from vescale.dtensor import _compat

__all__ = ["UNFLATTEN_ERROR", "VIEW_OPS_REDISTRIBUTING_ON_UNFLATTEN", "redistributing_on_unflatten"]

aten = torch.ops.aten

# The start of the error PyTorch's strict view strategy raises for an uneven unflatten.
UNFLATTEN_ERROR = "Cannot unflatten unevenly sharded tensor"
VIEW_OPS_REDISTRIBUTING_ON_UNFLATTEN = (aten.view.default, aten._unsafe_view.default)


def redistributing_on_unflatten(strict: Callable[[Any], Any], copying: Callable[[Any], Any]) -> Callable:
    """A strategy function: ``strict``'s, or ``copying``'s where ``strict`` refuses to unflatten.

    Example::

        lenient = redistributing_on_unflatten(strict_view_strategy, view_copy_strategy)
        _compat.set_dtensor_op_strategy(torch.ops.aten.view.default, lenient)
    """

    def strategy(op_schema: Any) -> Any:
        try:
            return strict(op_schema)
        except RuntimeError as error:
            if UNFLATTEN_ERROR not in str(error):
                raise
            return copying(op_schema)

    strategy.vescale_strict_strategy = strict  # type: ignore[attr-defined]
    return strategy


def _install() -> None:
    if aten.view_copy.default not in _compat.dtensor_strategy_registries()["op_strategy_funcs"]:
        # torch 2.11 registers no view_copy strategy: uneven unflattens keep PyTorch's error there.
        logging.getLogger("vescale.dtensor").debug(
            "torch %s has no DTensor strategy for view_copy; views of uneven shards stay strict",
            torch.__version__,
        )
        return
    copying = _compat.dtensor_op_strategy(aten.view_copy.default)
    for view_op in VIEW_OPS_REDISTRIBUTING_ON_UNFLATTEN:
        registered = _compat.dtensor_op_strategy(view_op)
        # Idempotent: a re-imported module wraps PyTorch's strategy, not its own wrapper.
        strict = getattr(registered, "vescale_strict_strategy", registered)
        _compat.set_dtensor_op_strategy(view_op, redistributing_on_unflatten(strict, copying))


_install()
