"""Safe, atomic, resharding checkpoints in safetensors, with Hugging Face import and
export.

Every rank writes its share of the distinct tensor chunks into one ``.safetensors`` file;
rank 0 writes a JSON index last and renames the directory into place. Loading reads only
the byte ranges each rank's shards overlap, into whatever layout the state has now.

Example::

    from vescale.dcheckpoint import RNGState, load, save
    save("ckpt/step-000100", {"model": model, "optimizer": optimizer, "rng": RNGState()})
    load("ckpt", {"model": model, "optimizer": optimizer, "rng": RNGState()})
"""

from importlib.metadata import version as _distribution_version

from vescale.dcheckpoint.api import AsyncSave, LoadResult, SaveResult, load, read_index, save
from vescale.dcheckpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointUsageError,
)
from vescale.dcheckpoint.rng import RNGState

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointUsageError",
    "LoadResult",
    "RNGState",
    "SaveResult",
    "__version__",
    "load",
    "read_index",
    "save",
]

__version__ = _distribution_version("vescale-dcheckpoint")
