"""Safe, atomic, resharding checkpoints in safetensors, with Hugging Face import and
export.

Every rank writes its share of the distinct tensor chunks into one ``.safetensors`` file;
rank 0 writes a JSON index last and renames the directory into place. Loading reads only
the byte ranges each rank's shards overlap, into whatever layout the state has now.
Hugging Face safetensors checkpoints load into parallelized models the same way
(``load_hf``), and ``export_hf`` writes one that ``from_pretrained`` loads.

Example::

    from vescale.dcheckpoint import RNGState, load, save
    save("ckpt/step-000100", {"model": model, "optimizer": optimizer, "rng": RNGState()})
    load("ckpt", {"model": model, "optimizer": optimizer, "rng": RNGState()})
"""

from importlib.metadata import version as _distribution_version

from vescale.dcheckpoint import errors
from vescale.dcheckpoint.api import (
    AsyncSave,
    LoadResult,
    SaveResult,
    load,
    prepare_async_save,
    read_index,
    save,
)
from vescale.dcheckpoint.errors import *  # noqa: F403  (every checkpoint error: errors.__all__)
from vescale.dcheckpoint.hf import export_hf, load_hf
from vescale.dcheckpoint.rng import RNGState

__all__ = [
    "AsyncSave",
    "LoadResult",
    "RNGState",
    "SaveResult",
    "__version__",
    "export_hf",
    "load",
    "load_hf",
    "prepare_async_save",
    "read_index",
    "save",
    *errors.__all__,
]

__version__ = _distribution_version("vescale-dcheckpoint")
