"""DModule: zero-code-change tensor and sequence parallelism for ``torch.nn.Module``,
deferred initialisation and automatic sharding plans.

Example::

    import vescale.dmodule
    print(vescale.dmodule.__version__)
"""

from importlib.metadata import version as _distribution_version

__all__ = ["__version__"]

__version__ = _distribution_version("vescale-dmodule")
