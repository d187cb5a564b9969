"""The ``Plan`` of an n-D parallel run and its automatic generation.

Example::

    plan = vescale.planner.generate_plan(model, {"tensor_parallel.size": 2}, world_size=8)
    print(plan); print(plan.explain())
    assert vescale.planner.Plan.from_json(plan.to_json()) == plan
"""

from importlib.metadata import version as _distribution_version

from vescale.planner.constraints import Constraints
from vescale.planner.errors import ConstraintError, PlanError, PlanFormatError
from vescale.planner.generate import generate_plan
from vescale.planner.hardware import HardwareProfile, load_hardware
from vescale.planner.memory import MemoryEstimate, ParallelChoices, estimate_memory
from vescale.planner.plan import Plan

__all__ = [
    "ConstraintError",
    "Constraints",
    "HardwareProfile",
    "MemoryEstimate",
    "ParallelChoices",
    "Plan",
    "PlanError",
    "PlanFormatError",
    "__version__",
    "estimate_memory",
    "generate_plan",
    "load_hardware",
]

__version__ = _distribution_version("vescale-planner")
