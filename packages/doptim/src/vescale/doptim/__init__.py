"""Data parallel and ZeRO stages 1-3 over any ``torch.optim`` optimizer, composed with
tensor parallel.

Example::

    import vescale.doptim
    print(vescale.doptim.__version__)
"""

from importlib.metadata import version as _distribution_version

__all__ = ["__version__"]

__version__ = _distribution_version("vescale-doptim")
