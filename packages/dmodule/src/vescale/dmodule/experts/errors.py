"""Errors of expert parallelism, each naming the module and the fix.

Example::

    try:
        parallelize_experts(model, mesh)
    except ExpertParallelError as error:
        print(error)   # "model.layers.0.mlp.experts: 6 experts do not split over ep=4 ..."
"""

from __future__ import annotations

from vescale.dmodule.errors import DModuleError

__all__ = ["ExpertParallelError", "UnsupportedExpertsError"]


class ExpertParallelError(DModuleError, ValueError):
    """An expert-parallel request that cannot be carried out (mesh, sizes, capacity factor)."""


class UnsupportedExpertsError(ExpertParallelError):
    """An experts module whose layout the dispatching forward does not implement."""
