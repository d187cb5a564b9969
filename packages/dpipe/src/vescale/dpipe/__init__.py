"""Pipeline parallelism for unmodified models, composable with tensor parallel, data
parallel and ZeRO.

Example::

    import vescale.dpipe
    print(vescale.dpipe.__version__)
"""

from importlib.metadata import version as _distribution_version

__all__ = ["__version__"]

__version__ = _distribution_version("vescale-dpipe")
