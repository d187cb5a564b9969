"""veScale's layer on PyTorch DTensor: meshes, extra placements, operator coverage,
single-device random numbers, communication accounting, and the multi-process test
harness (:mod:`vescale.dtensor.testing`).

Example::

    import vescale.dtensor
    print(vescale.dtensor.__version__)
"""

from importlib.metadata import version as _distribution_version

__all__ = ["__version__"]

__version__ = _distribution_version("vescale-dtensor")
