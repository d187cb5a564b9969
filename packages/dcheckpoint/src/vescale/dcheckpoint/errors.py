"""The exceptions of ``vescale.dcheckpoint``.

Each one is also a built-in exception of the matching kind (``CheckpointFormatError`` is a
``ValueError``, ``CheckpointNotFoundError`` a ``FileNotFoundError``), so callers that catch
the built-in keep working. Messages name the tensor key or file at fault and the fix.

Example::

    try:
        load("ckpt/step-100", {"model": model})
    except CheckpointMismatchError as error:
        print(error)   # names the key, the saved and the expected shape or dtype
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointUsageError",
]


class CheckpointError(Exception):
    """Base class of every error ``vescale.dcheckpoint`` raises on purpose."""


class CheckpointFormatError(CheckpointError, ValueError):
    """A checkpoint file or index is damaged, truncated, forged or of an unknown format."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the state it is loaded into: keys, shapes or dtypes differ."""


class CheckpointUsageError(CheckpointError, ValueError):
    """An argument of ``save`` or ``load`` is invalid (e.g. ``keep_last=0``)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint (no index, no ``latest`` pointer) at the given path."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save would overwrite an existing checkpoint, which would not be atomic."""
