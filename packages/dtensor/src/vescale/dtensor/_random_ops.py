"""DTensor op handlers that give random ops on DTensors their single-device values.

Three families, by what the op reads from its tensor argument (see
:class:`vescale.dtensor._random_strategy.RandomCall`): in-place fills (``normal_``,
``uniform_``, ``bernoulli_``, ``exponential_``... as ``nn.init`` and ``F.dropout`` on CPU
reach them), ``*_like`` factories, and maps that read the input values (``native_dropout``,
the fused dropout on CUDA; ``bernoulli`` of probabilities). Each computes the rank's shard
through :func:`vescale.dtensor._random_strategy.draw_local`.

Partial inputs: a fill writes the values on the ranks at coordinate 0 of each
``Partial("sum")`` mesh dim and zeros elsewhere, so the sum is exact (other reductions
raise); ``*_like`` outputs are Replicate there; maps reduce their input to Replicate first.
Every other random op of DTensor's random-op set is run locally when all its DTensor
arguments are Replicate (every rank then replays the single process) and raises
:class:`RandomOpError` otherwise.

Example::

    register_random_ops()
    torch.nn.init.normal_(sharded_weight)   # each shard holds its slice of the single-device values
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.utils._pytree import tree_flatten, tree_map

from vescale.dtensor import _compat
from vescale.dtensor._op_handlers import OpHandler, register_op_handlers
from vescale.dtensor._random_strategy import RandomCall, RandomOpError, draw_local

__all__ = ["RANDOM_OP_KINDS", "register_random_ops"]

aten = torch.ops.aten

RANDOM_OP_KINDS: dict[Any, str] = {
    **dict.fromkeys(
        [
            aten.normal_.default,
            aten.uniform_.default,
            aten.exponential_.default,
            aten.log_normal_.default,
            aten.cauchy_.default,
            aten.geometric_.default,
            aten.random_.default,
            getattr(aten.random_, "from"),  # "from" is a Python keyword
            aten.random_.to,
            aten.bernoulli_.float,
        ],
        "fill",
    ),
    **dict.fromkeys(
        [
            aten.rand_like.default,
            aten.rand_like.generator,
            aten.randn_like.default,
            aten.randn_like.generator,
            aten.randint_like.default,
            aten.randint_like.generator,
            aten.randint_like.low_dtype,
            aten.randint_like.low_generator_dtype,
            aten.bernoulli.p,
        ],
        "like",
    ),
    **dict.fromkeys([aten.native_dropout.default, aten.bernoulli.default], "map"),
}

# Random ops whose result depends on other tensor arguments elementwise (probabilities, means).
_REPLICATE_ONLY_OPS = [
    aten.bernoulli_.Tensor,
    aten.bernoulli.Tensor,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.poisson.default,
    aten.multinomial.default,
    aten.randint_like.Tensor,
    aten.randint_like.Tensor_generator,
    aten.randint_like.low_dtype_out,
]


def _describe(placements: Sequence[Placement]) -> str:
    return "[" + ", ".join(str(placement) for placement in placements) + "]"


def _partial_free(placements: Sequence[Placement]) -> list[Placement]:
    return [Replicate() if isinstance(placement, Partial) else placement for placement in placements]


def _split_generator(kwargs: dict[str, Any]) -> tuple[dict[str, Any], torch.Generator | None]:
    remaining = dict(kwargs)
    return remaining, remaining.pop("generator", None)


def _check_scalar_arguments(op_call: Any, args: Sequence[Any]) -> None:
    if any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(list(args))[0]):
        raise RandomOpError(
            f"{op_call} with a tensor argument besides its input is not supported on DTensors"
        )


def _keeps_partial_values(target: DTensor) -> bool:
    """Whether this rank holds the values of a fill on ``Partial("sum")`` mesh dims (else zeros)."""
    coordinate = target.device_mesh.get_coordinate()
    keeps = True
    for mesh_dim, placement in enumerate(target.placements):
        if not isinstance(placement, Partial):
            continue
        if placement.reduce_op != "sum":
            raise RandomOpError(
                f"in-place random op on a DTensor with placements {_describe(target.placements)}: "
                f"{placement} on mesh dim {mesh_dim} cannot hold random values exactly (only a sum can); "
                "redistribute it to Replicate first"
            )
        if coordinate is None:  # only a rank of the mesh holds a DTensor's values
            raise RandomOpError(
                f"a random op on a DTensor of mesh {target.device_mesh} ran on a rank outside that mesh; "
                "run it on the mesh's ranks only"
            )
        keeps = keeps and coordinate[mesh_dim] == 0
    return keeps


def _fill_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    target: DTensor = args[0]
    _check_scalar_arguments(op_call, args[1:])
    call_kwargs, generator = _split_generator(kwargs)
    local = target.to_local()
    if local.is_meta or target.device_mesh.get_coordinate() is None:
        op_call(local, *args[1:], **call_kwargs)
        return target
    keeps_values = _keeps_partial_values(target)
    shape, stride = tuple(target.shape), target.stride()

    def global_template() -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=local.dtype, device=local.device)

    call = RandomCall(op_call, "fill", tuple(args[1:]), call_kwargs, generator)
    draw_local(call, target.device_mesh, target.placements, shape, stride, global_template, local)
    if not keeps_values:
        local.zero_()
    return target


def _output_dtensors(
    op_call: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    source: DTensor,
    local_outputs: Sequence[torch.Tensor],
) -> object:
    """Wrap local outputs with the source's layout and the metadata the op gives a global input."""
    meta_input = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device="meta")
    meta_outputs, _ = tree_flatten(op_call(meta_input, *args[1:], **kwargs))
    dtensors = [
        DTensor.from_local(
            local,
            source.device_mesh,
            _partial_free(source.placements),
            run_check=False,
            shape=meta.shape,
            stride=meta.stride(),
        )
        for local, meta in zip(local_outputs, meta_outputs, strict=True)
    ]
    return tuple(dtensors) if len(dtensors) > 1 else dtensors[0]


def _like_or_map_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    source: DTensor = args[0]
    kind = RANDOM_OP_KINDS[op_call]
    _check_scalar_arguments(op_call, args[1:])
    call_kwargs, generator = _split_generator(kwargs)
    mesh = source.device_mesh
    if kind == "map" and any(isinstance(placement, Partial) for placement in source.placements):
        source = source.redistribute(mesh, _partial_free(source.placements))
    local = source.to_local()
    if local.is_meta or mesh.get_coordinate() is None:
        return _output_dtensors(
            op_call, args, call_kwargs, source, [op_call(local, *args[1:], **call_kwargs)]
        )
    shape, stride = tuple(source.shape), source.stride()

    def global_template() -> torch.Tensor:
        template = torch.empty_strided(shape, stride, dtype=local.dtype, device=local.device)
        if kind == "map":  # the op reads the values: every rank needs the whole input
            template.copy_(source.full_tensor())
        return template

    call = RandomCall(op_call, kind, tuple(args[1:]), call_kwargs, generator)
    local_outputs = draw_local(call, mesh, source.placements, shape, stride, global_template, local)
    return _output_dtensors(op_call, args, call_kwargs, source, local_outputs)


def _replicate_only_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    dtensors = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, DTensor)]
    mesh = dtensors[0].device_mesh
    for dtensor in dtensors:
        if not all(isinstance(placement, Replicate) for placement in dtensor.placements):
            raise RandomOpError(
                f"{op_call} on a DTensor with placements {_describe(dtensor.placements)} cannot be made "
                "to give the single-device values (its result depends on another tensor elementwise); "
                f"redistribute its DTensor arguments to {_describe([Replicate()] * mesh.ndim)} first"
            )
    local_args, local_kwargs = tree_map(
        lambda x: x.to_local() if isinstance(x, DTensor) else x, (args, kwargs)
    )
    result = op_call(*local_args, **local_kwargs)
    if _compat.op_schema(op_call).is_mutable:
        return args[0]
    return tree_map(
        lambda x: (
            DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
            if isinstance(x, torch.Tensor)
            else x
        ),
        result,
    )


def register_random_ops() -> None:
    """Install the handlers for every random op DTensor knows of (idempotent).

    Example::

        register_random_ops()
        dropped = torch.nn.functional.dropout(sharded_activation, p=0.1)
    """
    handlers: dict[Any, OpHandler] = {
        op: _fill_handler if kind == "fill" else _like_or_map_handler for op, kind in RANDOM_OP_KINDS.items()
    }
    for op in [*_REPLICATE_ONLY_OPS, *_compat.dtensor_random_ops()]:
        handlers.setdefault(op, _replicate_only_handler)
    # aten.rand/randn take no tensor and never reach a handler; the RNG tracker covers them.
    handlers.pop(aten.rand.default, None)
    handlers.pop(aten.randn.default, None)
    register_op_handlers(handlers)
