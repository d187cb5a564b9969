"""Sharding strategies torch 2.13's DTensor registers and torch 2.11's lacks.

``detach_`` (in-place detach, which autograd calls on the output of a ``DTensor.redistribute``
made inside a per-op handler, e.g. grouped_mm's backward) gets ``detach``'s strategy: the
placements stay as they are. Installed on torch < 2.13 only.

Example::

    import vescale.dtensor.ops   # on torch 2.11, registers detach_
    weight.redistribute(mesh, [Replicate()])   # inside a handler: no missing-strategy error
"""

from __future__ import annotations

import torch

from vescale.dtensor import _compat

__all__ = ["STRATEGIES_LIKE"]

aten = torch.ops.aten
# {op missing on torch 2.11: the op whose strategy it shares on torch 2.13}
STRATEGIES_LIKE = {aten.detach_.default: aten.detach.default}


def _install() -> None:
    registered = _compat.dtensor_strategy_registries()["op_strategy_funcs"]
    for op, like in STRATEGIES_LIKE.items():
        if op not in registered:
            _compat.register_dtensor_op_strategy_like(op, like)


_install()
