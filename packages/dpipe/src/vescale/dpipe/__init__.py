"""Pipeline parallelism for unmodified models, composable with tensor parallel, data
parallel and ZeRO.

Example::

    from vescale.dpipe import PipelinePlan, pipeline_parallelize
    model = pipeline_parallelize(model, init_mesh(pp=2), PipelinePlan(size=2, num_microbatches=4))
    model(input_ids=input_ids, labels=labels).loss.backward()
"""

from importlib.metadata import version as _distribution_version

from vescale.dpipe.errors import (
    MicrobatchError,
    PipelineArgumentError,
    PipelineCheckpointingError,
    PipelineCutError,
    PipelineError,
    PipelinePlanError,
    ScaledLossError,
    SplitPointError,
    StageCountError,
)
from vescale.dpipe.finished_loss import loss_with_backward_done
from vescale.dpipe.pipeline_module import PipelineModule, pipeline_parallelize
from vescale.dpipe.plan import SCHEDULES, SPLIT_METHODS, PipelinePlan

__all__ = [
    "SCHEDULES",
    "SPLIT_METHODS",
    "MicrobatchError",
    "PipelineArgumentError",
    "PipelineCheckpointingError",
    "PipelineCutError",
    "PipelineError",
    "PipelineModule",
    "PipelinePlan",
    "PipelinePlanError",
    "ScaledLossError",
    "SplitPointError",
    "StageCountError",
    "__version__",
    "loss_with_backward_done",
    "pipeline_parallelize",
]

__version__ = _distribution_version("vescale-dpipe")
