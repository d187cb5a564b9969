"""Safe, atomic, resharding checkpoints in safetensors, with Hugging Face import and
export.

Example::

    import vescale.dcheckpoint
    print(vescale.dcheckpoint.__version__)
"""

from importlib.metadata import version as _distribution_version

__all__ = ["__version__"]

__version__ = _distribution_version("vescale-dcheckpoint")
