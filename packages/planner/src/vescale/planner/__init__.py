"""The ``Plan`` of an n-D parallel run and its automatic generation.

Example::

    import vescale.planner
    print(vescale.planner.__version__)
"""

from importlib.metadata import version as _distribution_version

__all__ = ["__version__"]

__version__ = _distribution_version("vescale-planner")
