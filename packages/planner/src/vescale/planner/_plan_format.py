"""The fixed vocabulary of a plan's JSON form, shared by the ``Plan`` type and its parser.

Example::

    assert plan.to_dict()["format"] == PLAN_FORMAT
"""

from __future__ import annotations

from vescale.dmodule.errors import DModuleError
from vescale.doptim.errors import DOptimError
from vescale.dpipe.errors import PipelineError

__all__ = ["ACTIVATION_CHECKPOINTING", "MESH_DIMS", "PLAN_FORMAT", "SECTION_ERRORS", "TOP_LEVEL_KEYS"]

MESH_DIMS = ("pp", "dp", "ep", "tp")
"""The canonical order of the mesh dimensions, outermost first."""
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
PLAN_FORMAT = "vescale.plan/1"
TOP_LEVEL_KEYS = (
    "format",
    "mesh",
    "tensor_parallel",
    "pipeline_parallel",
    "expert_parallel",
    "data_parallel",
    "micro_batching",
    "activation_checkpointing",
    "memory",
    "performance",
    "reasons",
)
SECTION_ERRORS = (DModuleError, PipelineError, DOptimError)
"""The errors the section classes raise; the planner re-raises them as ``PlanFormatError``."""
