"""The exceptions of ``vescale.dtensor``.

Each one is also a built-in exception of the matching kind (``MeshError`` is a
``ValueError``), so callers that catch the built-in keep working.

Example::

    try:
        init_mesh(dp=3, tp=2)
    except MeshError as error:
        print(error)   # names the dims, their product and the world size
"""

from __future__ import annotations

__all__ = ["DTensorError", "MeshError"]


class DTensorError(Exception):
    """Base class of veScale's DTensor-layer errors."""


class MeshError(DTensorError, ValueError):
    """A device mesh cannot be built as asked: unknown dim names, bad sizes, wrong product."""
