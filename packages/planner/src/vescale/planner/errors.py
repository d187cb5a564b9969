"""The exceptions of ``vescale.planner``.

Each is also the built-in exception of the matching kind (a ``ConstraintError`` is a
``ValueError``), so callers that catch the built-in keep working.

Example::

    try:
        Constraints.from_dict({"tensor_parallel.sizes": 2})
    except ConstraintError as error:
        print(error)   # unknown constraint 'tensor_parallel.sizes'; did you mean 'tensor_parallel.size'?
"""

from __future__ import annotations

__all__ = ["ConstraintError", "PlanError", "PlanFormatError"]


class PlanError(Exception):
    """Base class of the errors raised by ``vescale.planner``."""


class ConstraintError(PlanError, ValueError):
    """A constraint is unknown, has the wrong type or value, or contradicts another one."""


class PlanFormatError(PlanError, ValueError):
    """A plan (or its JSON) has an unknown, missing or inconsistent field; the message names it."""
