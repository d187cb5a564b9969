"""veScale's entries in DTensor's per-op handler table, with a way back to what they replaced.

DTensor lets a handler take over the whole dispatch of one aten op (the table behind
:func:`vescale.dtensor._compat.dtensor_custom_op_handlers`). A veScale handler usually
covers only some calls of its op (one layout, one argument form) and hands the others on:
:func:`dispatch_previous` calls the handler that was registered before veScale's, or,
when there was none, DTensor's default dispatch, by taking veScale's handler out of the
table for that one call. A thread that dispatches the same op at that instant also gets
the default dispatch, which computes the same values, possibly with more communication.

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

__all__ = ["OpHandler", "dispatch_previous", "register_op_handlers"]

OpHandler = Callable[[Any, tuple, dict], object]

_default_dispatch_lock = threading.RLock()
_previous_handlers: dict[Any, OpHandler | None] = {}
# DTensor's handler table is one dict for the life of the process; resolved once, off the hot path.
_handler_table: dict[Any, OpHandler] | None = None


def _handlers() -> dict[Any, OpHandler]:
    global _handler_table
    if _handler_table is None:
        _handler_table = _compat.dtensor_custom_op_handlers()
    return _handler_table


def dispatch_previous(op_call: Any, args: tuple, kwargs: dict) -> object:
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
        if handlers.get(op) is not handler:
            _previous_handlers[op] = handlers.get(op)
            handlers[op] = handler
