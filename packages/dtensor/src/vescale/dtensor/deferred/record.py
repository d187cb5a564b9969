"""The deferred-initialisation record: the protocol every package materialises from.

A record is the ordered list of the aten ops a module's constructor ran, as seen at the
dispatch level, with tensors replaced by :class:`TensorRef` (which storage, and the view of
it: dtype, size, stride, offset). Each op says which storages it creates, writes and reads,
and a random op carries the state of its generator just before it ran, so replaying it
draws exactly the numbers eager construction drew. Every deferred parameter and buffer
carries a :class:`DeferredHandle` (its record, its ``TensorRef`` and the record's length
when construction ended), so dmodule (TP), doptim (ZeRO-3) and dpipe can each materialise
the tensors they own, whichever module they hold.

Example::

    handle = deferred_handle(model.lm_head.weight)
    needed_ops = handle.record.ops_for({handle.ref.storage_id}, handle.position)
    print(len(needed_ops), "ops rebuild lm_head.weight")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vescale.dtensor.deferred.errors import NotDeferredError

__all__ = [
    "HANDLE_ATTRIBUTE",
    "DeferredHandle",
    "InitRecord",
    "RecordedOp",
    "TensorRef",
    "deferred_handle",
    "is_deferred",
]

# The attribute a deferred tensor carries its handle in (tensors accept Python attributes).
HANDLE_ATTRIBUTE = "_vescale_deferred_handle"


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a record: a view (dtype, size, stride, offset) of one recorded storage."""

    storage_id: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor, storage_id: int) -> TensorRef:
        return cls(
            storage_id,
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
        )

    def covers(self, storage_nbytes: int) -> bool:
        """Whether this view is the whole storage, densely: writing all of it leaves nothing older."""
        numel = 1
        for extent in self.size:
            numel *= extent
        itemsize = torch.empty((), dtype=self.dtype, device="meta").element_size()
        return (
            self.storage_offset == 0
            and numel * itemsize == storage_nbytes
            and torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="meta").is_contiguous()
        )


@dataclass(frozen=True)
class RecordedOp:
    """One op of a record. ``args``/``kwargs`` hold ``TensorRef``s, constants (real tensors) and scalars.

    ``created`` pairs a flat output index with the storage it creates; ``overwritten`` are
    the written storages whose old contents the op neither reads nor keeps any of;
    ``generator_state`` is the CPU generator's state before a random op (``None`` otherwise).
    """

    op: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    created: tuple[tuple[int, int], ...]
    written: frozenset[int]
    read: frozenset[int]
    overwritten: frozenset[int]
    generator_state: torch.Tensor | None = None
    generator_argument: bool = False


@dataclass
class InitRecord:
    """The ops of one deferred construction, in order, and the size of every storage they touch."""

    ops: list[RecordedOp] = field(default_factory=list)
    storage_nbytes: dict[int, int] = field(default_factory=dict)

    def ops_for(self, storage_ids: set[int], position: int) -> list[RecordedOp]:
        """The ops (in order) that rebuild ``storage_ids`` as they were after the first ``position`` ops.

        A backward pass over the record: an op is needed when it creates or writes a
        needed storage; it then needs what it reads, and a storage it overwrites entirely
        needs nothing older (so the ``nn`` default init that ``_init_weights`` redraws is
        not replayed).
        """
        needed = set(storage_ids)
        selected = []
        for recorded in reversed(self.ops[:position]):
            created = {storage_id for _, storage_id in recorded.created}
            if needed & (created | recorded.written):
                selected.append(recorded)
                needed -= created | recorded.overwritten
                needed |= recorded.read
        selected.reverse()
        return selected


@dataclass(frozen=True)
class DeferredHandle:
    """What a deferred tensor needs to be materialised: its record, its view, where construction
    ended, and the dtype and device a conversion of the module (``model.to(torch.bfloat16)``)
    gave it since (``None``: as recorded; :mod:`.conversion`). ``version`` is the tensor's
    in-place version counter then: an in-place op after construction (``nn.init.zeros_``, a
    ``copy_``) bumps it, and the record does not hold that op."""

    record: InitRecord
    ref: TensorRef
    position: int
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    version: int = 0


def deferred_handle(tensor: torch.Tensor, name: str = "tensor") -> DeferredHandle:
    """The handle of a deferred tensor; raises :class:`NotDeferredError` (naming ``name``) otherwise.

    Example::

        model = deferred_init(torch.nn.Linear, 4, 4)
        deferred_handle(model.weight, "weight").ref.size   # (4, 4)
    """
    handle = getattr(tensor, HANDLE_ATTRIBUTE, None)
    if not isinstance(handle, DeferredHandle):
        raise NotDeferredError(
            f"{name} (shape {tuple(tensor.shape)}, {type(tensor).__name__}) was not built by deferred_init; "
            "construct the module with vescale.dmodule.deferred_init(ModelClass, *args) to materialise it"
        )
    return handle


def is_deferred(tensor: Any) -> bool:
    """Whether ``tensor`` is a deferred (not yet materialised) parameter or buffer.

    Example::

        model = deferred_init(torch.nn.Linear, 4, 4)
        assert is_deferred(model.weight) and not is_deferred(torch.ones(1))
    """
    return isinstance(getattr(tensor, HANDLE_ATTRIBUTE, None), DeferredHandle)
