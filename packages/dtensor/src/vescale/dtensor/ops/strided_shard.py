"""torch 2.11: strategies that move a ``_StridedShard`` (an ``InterleavedShard``) to its new dim.

On torch 2.11, DTensor's strategies for ``t``, ``select`` and its backward rewrite ``Shard(d)`` to the dim
it moves to, but leave a ``_StridedShard(d, k)`` as it is: ``weight.t()`` of an interleaved
``[3h, in]`` weight claims ``_StridedShard(0)`` on ``[in, 3h]``, and ``experts[e]`` of an
interleaved ``[e, 2i, h]`` tensor claims dim 1 of the 2-D result, so the next matmul
multiplies the wrong shapes. torch 2.13 moves them like ``Shard``. These ops move whole dims
without cutting the sharded one, so here the strategy decides as if each ``_StridedShard``
were a ``Shard`` of the same dim, and every mesh dim that held one gets it back, moved to the
dim its ``Shard`` went to. Installed on torch < 2.13 only; decisions are cached, so this runs
once per op schema.

Example::

    import vescale.dtensor.ops   # on torch 2.11, wraps t, select and select_backward
    weight.t().placements        # (_StridedShard(dim=1, sf=3),) for an IS(0,3) weight
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import Placement, Shard

from vescale.dtensor import _compat

__all__ = ["OPS_MOVING_STRIDED_SHARDS", "moving_strided_shards"]

aten = torch.ops.aten
OPS_MOVING_STRIDED_SHARDS = (aten.t.default, aten.select.int, aten.select_backward.default)
_STRIDED_SHARD = _compat.strided_shard_type()
_WRAPPED_ATTRIBUTE = "vescale_strided_shard_reader"


def _as_shard(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim) if isinstance(p, _STRIDED_SHARD) else p for p in placements)


def _restrided(spec: Any, split_factors: dict[int, Any]) -> Any:
    """``spec`` with the ``Shard`` on each mesh dim of ``split_factors`` made strided again."""
    if spec is None:
        return None
    placements = tuple(
        _STRIDED_SHARD(p.dim, split_factor=split_factors[mesh_dim])
        if mesh_dim in split_factors and type(p) is Shard
        else p
        for mesh_dim, p in enumerate(spec.placements)
    )
    return _compat.dtensor_strategy_type("dtensor_spec")(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def moving_strided_shards(strategy: Callable[[Any], Any]) -> Callable[..., Any]:
    """``strategy`` deciding for a ``_StridedShard`` input as for a ``Shard`` of the same dim.

    Example::

        fixed = moving_strided_shards(_compat.dtensor_op_strategy(torch.ops.aten.t.default))
        _compat.set_dtensor_op_strategy(torch.ops.aten.t.default, fixed)
    """

    def reading_strided_as_shard(op_schema: Any) -> Any:
        input_strategy = op_schema.args_schema[0]
        input_specs = [op_spec.output_spec for op_spec in getattr(input_strategy, "strategies", ())]
        if len(input_specs) != 1 or not any(isinstance(p, _STRIDED_SHARD) for p in input_specs[0].placements):
            return strategy(op_schema)
        input_spec = input_specs[0]
        split_factors = {
            mesh_dim: p.split_factor
            for mesh_dim, p in enumerate(input_spec.placements)
            if isinstance(p, _STRIDED_SHARD)
        }
        spec_type = _compat.dtensor_strategy_type("dtensor_spec")
        op_spec_type = _compat.dtensor_strategy_type("op_spec")
        as_shard = spec_type(
            input_spec.mesh, _as_shard(input_spec.placements), tensor_meta=input_spec.tensor_meta
        )
        shard_input = _compat.dtensor_strategy_type("op_strategy")([op_spec_type(as_shard)])
        decided = strategy(
            _compat.dtensor_strategy_type("op_schema")(
                op_schema.op,
                (shard_input, *op_schema.args_schema[1:]),
                op_schema.kwargs_schema,
                schema_info=op_schema.schema_info,
            )
        )
        for index, op_spec in enumerate(decided.strategies):
            input_specs_back = (
                None
                if op_spec.input_specs is None
                else tuple(_restrided(spec, split_factors) for spec in op_spec.input_specs)
            )
            decided.strategies[index] = op_spec_type(
                _restrided(op_spec.output_spec, split_factors), input_specs_back, op_spec.redistribute_cost
            )
        return decided

    setattr(reading_strided_as_shard, _WRAPPED_ATTRIBUTE, strategy)
    return reading_strided_as_shard


def _install() -> None:
    if _compat.torch_version() >= (2, 13):
        return
    for op in OPS_MOVING_STRIDED_SHARDS:
        registered = _compat.dtensor_op_strategy(op)
        original = getattr(registered, _WRAPPED_ATTRIBUTE, registered)
        _compat.set_dtensor_op_strategy(op, moving_strided_shards(original))


_install()
