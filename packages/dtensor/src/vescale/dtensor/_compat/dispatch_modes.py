"""What vescale's TorchDispatchModes (communication accounting, deferred initialisation, the
debug and coverage modes) need below autograd: the mode base class, collective namespaces and
process groups, the running autograd node, fake tensors, op schemas and storage identities.

Private PyTorch APIs: ``torch.utils._python_dispatch`` (``TorchDispatchMode``,
``_disable_current_modes``, ``_get_current_dispatch_mode_stack``),
``torch.distributed.distributed_c10d._resolve_process_group``,
``torch._C._current_autograd_node``, ``torch.autograd.function.BackwardCFunction``,
``torch._subclasses.fake_tensor`` (``FakeTensorMode``, ``FakeTensor``,
``DataDependentOutputException``, ``DynamicOutputShapeException``), ``OpOverload._schema`` and
``UntypedStorage._cdata``.

Example::

    from vescale.dtensor._compat.dispatch_modes import fake_tensor_mode_class
    with fake_tensor_mode_class()(allow_non_fake_inputs=True):
        ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import torch

from vescale.dtensor._compat.core import (
    PrivateTorchAPIError,
    _private_attribute,
    _private_class,
    unsupported_torch,
)

if TYPE_CHECKING:
    _ModeT = TypeVar("_ModeT", bound="TorchDispatchMode")

    class TorchDispatchMode:
        """For the type checker only: the part of ``torch.utils._python_dispatch.TorchDispatchMode``
        that vescale uses, annotated (torch leaves it unannotated). vescale's dispatch modes subclass
        it under ``TYPE_CHECKING`` and subclass ``torch_dispatch_mode_class()`` at run time."""

        def __init__(self) -> None: ...
        def __enter__(self: _ModeT) -> _ModeT: ...
        def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> None: ...
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any: ...


__all__ = [
    "C10D_COLLECTIVE_NAMESPACE",
    "DTENSOR_OP_NAMESPACE",
    "FUNCTIONAL_COLLECTIVE_NAMESPACE",
    "current_autograd_node",
    "custom_function_backward_class",
    "disable_dispatch_modes",
    "dispatch_mode_active",
    "fake_tensor_class",
    "fake_tensor_data_dependent_errors",
    "fake_tensor_mode_class",
    "op_schema",
    "resolve_process_group",
    "storage_key",
    "torch_dispatch_mode_class",
]


# --- communication accounting (vescale.dtensor.comm) --------------------------------------
# Collectives run below autograd, where only a TorchDispatchMode sees them; torch keeps that
# class in a private module. Functional collectives name their process group by a string,
# and only a private resolver turns a name that belongs to no known mesh into its group.
# During backward, only a private query tells which autograd node is running.

FUNCTIONAL_COLLECTIVE_NAMESPACE = "_c10d_functional"
C10D_COLLECTIVE_NAMESPACE = "c10d"
# DTensor's own ops (``torch.ops._dtensor.shard_dim_alltoall``, the NCCL all-to-all).
DTENSOR_OP_NAMESPACE = "_dtensor"


def torch_dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base of vescale's dispatch modes."""
    return _private_class("torch.utils._python_dispatch", "TorchDispatchMode")


def resolve_process_group(group_name: str) -> Any:
    """The ``ProcessGroup`` registered under ``group_name`` (as functional collectives name it)."""
    resolve = _private_attribute("torch.distributed.distributed_c10d", "_resolve_process_group", None)
    return resolve(group_name)


def current_autograd_node() -> Any:
    """The autograd ``Node`` whose backward is running on this thread, or ``None`` outside backward."""
    return _private_attribute("torch._C", "_current_autograd_node", None)()


def custom_function_backward_class() -> type:
    """``BackwardCFunction``: the node class whose ``apply(*grads)`` runs a custom Function's backward."""
    return _private_class("torch.autograd.function", "BackwardCFunction")


# --- deferred initialisation (vescale.dtensor.deferred) -----------------------------------
# Deferred construction runs a module's constructor on fake tensors (meta storage, but they
# report the real device, so nn.init's `if tensor.is_meta: return` shortcuts are not taken)
# under a recording dispatch mode. FakeTensorMode, its data-dependent exceptions and the way
# to step outside every active dispatch mode (to draw real random numbers mid-recording)
# are private; so are an op's schema (which arguments it writes) and a storage's identity.


def fake_tensor_mode_class() -> type:
    """``torch._subclasses.fake_tensor.FakeTensorMode``: tensors with shapes but no data."""
    return _private_class("torch._subclasses.fake_tensor", "FakeTensorMode")


def fake_tensor_class() -> type[torch.Tensor]:
    """``torch._subclasses.fake_tensor.FakeTensor``, the tensor type FakeTensorMode creates."""
    fake_tensor: type[torch.Tensor] = _private_attribute("torch._subclasses.fake_tensor", "FakeTensor", type)
    return fake_tensor


def fake_tensor_data_dependent_errors() -> tuple[type[Exception], ...]:
    """The exceptions FakeTensorMode raises for ops whose result depends on tensor values."""
    return tuple(
        _private_attribute("torch._subclasses.fake_tensor", name, type)
        for name in ("DataDependentOutputException", "DynamicOutputShapeException")
    )


def disable_dispatch_modes() -> Any:
    """A context manager under which no TorchDispatchMode (fake or recording) is active."""
    return _private_attribute("torch.utils._python_dispatch", "_disable_current_modes", None)()


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode is active on this thread (fake tensors, selective
    activation checkpointing's op cache, a recording mode)."""
    stack = _private_attribute("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack", None)
    if not callable(stack):
        raise unsupported_torch(
            "torch.utils._python_dispatch._get_current_dispatch_mode_stack is not callable"
        )
    return bool(stack())


def op_schema(op: Any) -> Any:
    """The ``torch.FunctionSchema`` of an ``OpOverload`` (its arguments and their alias info)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not hasattr(schema, "arguments"):
        raise PrivateTorchAPIError(
            f"{op!r} has no _schema.arguments in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    return schema


def storage_key(tensor: torch.Tensor) -> int:
    """An id of ``tensor``'s storage, equal for every view of it (valid while the storage lives)."""
    storage = tensor.untyped_storage()
    if not hasattr(storage, "_cdata"):
        raise PrivateTorchAPIError(
            f"torch.UntypedStorage has no _cdata in torch {torch.__version__}; "
            "update vescale/dtensor/_compat/ for this release."
        )
    key: int = storage._cdata
    return key
