"""veScale's entries in DTensor's per-op handler table, with a way back to what they replaced.

DTensor lets a handler take over the whole dispatch of one aten op (the table behind
:func:`vescale.dtensor._compat.dtensor_custom_op_handlers`). A veScale handler usually
covers only some calls of its op (one layout, one argument form) and hands the others on:
:func:`dispatch_previous` calls the handler that was registered before veScale's, or,
when there was none, DTensor's default dispatch, by taking veScale's handler out of the
table for that one call. A thread that dispatches the same op at that instant also gets
the default dispatch, which computes the same values, possibly with more communication.

The table is shared: PyTorch's ``loss_parallel()`` puts its own loss handlers over veScale's
on entry and deletes them on exit, which would leave those ops with no handler at all. So
veScale keeps the table as a :class:`HandlerTable`, where deleting a handler that was put
over one of veScale's brings veScale's back, as closing a scope should. A handler is a
per-call Python detour for every DTensor of its op; ops that need no communication of their
own are better served by a sharding strategy (see :mod:`vescale.dtensor._interleaved_ops`).

Example::

    def split_handler(op_call, args, kwargs):
        if not handles(args):
            return dispatch_previous(op_call, args, kwargs)
        ...

    register_op_handlers({torch.ops.aten.split.Tensor: split_handler})
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from vescale.dtensor import _compat

__all__ = ["HandlerTable", "OpHandler", "dispatch_previous", "register_op_handlers"]

OpHandler = Callable[[Any, tuple[Any, ...], dict[str, Any]], object]

_default_dispatch_lock = threading.RLock()
_previous_handlers: dict[Any, OpHandler | None] = {}
# veScale's own handler of each op it registered, to bring back when a handler over it goes.
_own_handlers: dict[Any, OpHandler] = {}

_MISSING = object()


class HandlerTable(dict[Any, Any]):
    """DTensor's handler table, where deleting a handler put over veScale's restores veScale's.

    Example::

        with torch.distributed.tensor.parallel.loss_parallel():   # PyTorch's loss handlers
            ...
        # on exit PyTorch deletes them; veScale's vocabulary-parallel loss handlers are back
    """

    def pop(self, op: Any, *default: Any) -> Any:
        removed = dict.get(self, op, _MISSING)
        value = dict.pop(self, op, *default)
        self._restore_own(op, removed)
        return value

    def __delitem__(self, op: Any) -> None:
        removed = dict.__getitem__(self, op)
        dict.__delitem__(self, op)
        self._restore_own(op, removed)

    def _restore_own(self, op: Any, removed: Any) -> None:
        own = _own_handlers.get(op)
        # Removing veScale's own handler (dispatch_previous, or on purpose) keeps it removed.
        if own is not None and removed is not _MISSING and removed is not own:
            dict.__setitem__(self, op, own)


def _handlers() -> HandlerTable:
    table = _compat.dtensor_custom_op_handlers()
    if not isinstance(table, HandlerTable):
        table = HandlerTable(table)
        _compat.set_dtensor_custom_op_handlers(table)
    return table


def dispatch_previous(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """Dispatch ``op_call`` as DTensor would without veScale's handler for it.

    Example::

        return dispatch_previous(op_call, args, kwargs)   # inside a handler, for calls it does not cover
    """
    previous = _previous_handlers.get(op_call)
    if previous is not None:
        return previous(op_call, args, kwargs)
    handlers = _handlers()
    with _default_dispatch_lock:
        own_handler = handlers.pop(op_call, None)
        try:
            return op_call(*args, **kwargs)
        finally:
            if own_handler is not None:
                handlers[op_call] = own_handler


def register_op_handlers(op_handlers: Mapping[Any, OpHandler]) -> None:
    """Install handlers in DTensor's op table (idempotent), remembering the ones they replace.

    Example::

        register_op_handlers({torch.ops.aten.cat.default: cat_handler})
    """
    handlers = _handlers()
    for op, handler in op_handlers.items():
        _own_handlers[op] = handler
        if handlers.get(op) is not handler:
            _previous_handlers[op] = handlers.get(op)
            handlers[op] = handler
