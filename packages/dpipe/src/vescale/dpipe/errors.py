"""The exceptions of ``vescale.dpipe``.

Each one is also the built-in exception of its kind (a bad plan value is a ``ValueError``),
so callers that catch the built-in keep working. Messages name the module FQN, stage or
plan field at fault and say how to fix it.

Example::

    try:
        pipeline_parallelize(model, mesh, PipelinePlan(size=2, split_points=("layers.9",)))
    except SplitPointError as error:
        print(error)   # names the split point and the closest module FQNs
"""

from __future__ import annotations

__all__ = [
    "MicrobatchError",
    "PipelineArgumentError",
    "PipelineCheckpointingError",
    "PipelineCutError",
    "PipelineError",
    "PipelinePlanError",
    "ScaledLossError",
    "SplitPointError",
    "StageCountError",
]


class PipelineError(Exception):
    """Base class of every error ``vescale.dpipe`` raises on purpose."""


class PipelinePlanError(PipelineError, ValueError):
    """A :class:`~vescale.dpipe.PipelinePlan` field is invalid or inconsistent with another."""


class SplitPointError(PipelinePlanError):
    """A split point names no module of the model (the message lists the closest FQNs)."""


class StageCountError(PipelinePlanError):
    """More pipeline stages are asked for than the model has blocks or split points allow."""


class MicrobatchError(PipelineError, ValueError):
    """The batch cannot be cut into the configured number of equal micro-batches."""


class PipelineArgumentError(PipelineError, ValueError):
    """A call passes a model argument that every stage fixes to another value (``use_cache=True``)."""


class PipelineCutError(PipelineError, ValueError):
    """The model's forward cannot be cut at the requested place (the message says where and why)."""


class PipelineCheckpointingError(PipelineError, RuntimeError):
    """The model runs reentrant activation checkpointing, which a pipeline stage's backward cannot run."""


class ScaledLossError(PipelineError, ValueError):
    """A factor was put on a loss whose backward already ran inside the call that returned it."""
