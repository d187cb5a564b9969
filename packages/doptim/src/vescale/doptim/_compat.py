"""The private PyTorch APIs that ``vescale.doptim`` relies on, confined to this module.

Gradient buckets must be waited for when the backward pass ends, and PyTorch offers no
public end-of-backward hook; autograd's engine has ``queue_callback``. FSDP2 passes each
unit's inputs through ``RegisterPostBackwardFunction``, whose unused outputs' gradients
autograd materialises as plain zeros, which a DTensor input cannot add up with
(:func:`unmaterialized_fsdp_post_backward`). Each accessor names
the private attribute it reads, and ``tests/test_doptim_compat.py`` fails loudly when a
PyTorch release renames or removes one.

Example::

    from vescale.doptim import _compat
    _compat.queue_end_of_backward_callback(lambda: print("backward finished"))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

# One supported torch range and one error type for every package's _compat.py: vescale.dtensor's.
from vescale.dtensor._compat import MIN_TORCH, TESTED_TORCH, PrivateTorchAPIError, unsupported_torch

__all__ = [
    "MIN_TORCH",
    "TESTED_TORCH",
    "PrivateTorchAPIError",
    "queue_end_of_backward_callback",
    "unmaterialized_fsdp_post_backward",
]


class _AutogradEngine(Protocol):
    def queue_callback(self, callback: Callable[[], None]) -> None: ...


def _autograd_engine() -> _AutogradEngine:
    engine: _AutogradEngine | None = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or not callable(getattr(engine, "queue_callback", None)):
        raise unsupported_torch(
            "torch.autograd.Variable._execution_engine.queue_callback is missing", "vescale.doptim"
        )
    return engine


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` once the backward pass now executing finishes (call it during backward)."""
    _autograd_engine().queue_callback(callback)


_FSDP_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def unmaterialized_fsdp_post_backward() -> None:
    """Make FSDP2's ``RegisterPostBackwardFunction`` pass a missing gradient on as missing (idempotent).

    FSDP2 runs every input of a unit that requires grad through one autograd function (to reduce
    the unit's gradients after its backward). An input the unit does not use (Zamba2's first
    layer is handed the embeddings its hybrid layers concatenate) gets no gradient there, and
    autograd materialises one as plain zeros of the global shape; added to the DTensor gradient
    from the input's other uses, it fails: "aten.add.Tensor got mixed torch.Tensor and DTensor".
    Without materialisation the input simply receives no gradient from the unit, as without FSDP.

    Example::

        unmaterialized_fsdp_post_backward()   # before fully_shard on a tensor-parallel model
    """
    module = importlib.import_module(_FSDP_PARAM_GROUP)
    original: Any = getattr(module, "RegisterPostBackwardFunction", None)
    if not (isinstance(original, type) and issubclass(original, torch.autograd.Function)):
        raise unsupported_torch(
            f"{_FSDP_PARAM_GROUP}.RegisterPostBackwardFunction is missing or not an autograd Function",
            "vescale.doptim",
        )
    if getattr(original, "vescale_unmaterialized", False):
        return

    class _UnmaterializedPostBackward(original):  # type: ignore[misc]  # a class found at run time
        vescale_unmaterialized = True

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            original.setup_context(ctx, inputs, output)
            ctx.set_materialize_grads(False)

    setattr(module, "RegisterPostBackwardFunction", _UnmaterializedPostBackward)  # noqa: B010
