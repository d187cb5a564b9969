"""The pipeline section of a veScale plan: how many stages, where to cut, which schedule.

The planner assembles one :class:`PipelinePlan` into its ``Plan``; it round-trips through
JSON exactly (``to_dict``/``from_dict``), so a user can edit it by hand.

Example::

    plan = PipelinePlan(size=2, schedule="1f1b", num_microbatches=4)
    assert PipelinePlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vescale.dpipe.errors import PipelinePlanError

__all__ = ["SCHEDULES", "SPLIT_METHODS", "PipelinePlan"]

# "manual" cuts before each module named in split_points; the others choose cuts among the
# model's repeated blocks.
SPLIT_METHODS = ("manual", "uniform", "params", "flops")
# Schedule name -> how many stages each rank must hold ("v" means any number >= 1).
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
_SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipelinePlan:
    """How a model is cut into pipeline stages and scheduled.

    ``size`` is the ``pp`` mesh dimension; each rank holds ``virtual_stages`` stages, so the
    model is cut into ``size * virtual_stages`` stages. ``split_points`` (module FQNs, the
    cut is before each) are used when ``split_method == "manual"``. ``num_microbatches``
    defaults to the number of stages.

    Example::

        plan = PipelinePlan(size=2, split_method="manual", split_points=("model.layers.2",))
        assert plan.num_stages == 2
    """

    size: int
    split_method: str = "uniform"
    split_points: tuple[str, ...] = ()
    schedule: str = "1f1b"
    num_microbatches: int | None = None
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        # JSON gives lists; the plan is hashable and frozen, so keep a tuple.
        object.__setattr__(self, "split_points", tuple(self.split_points))
        if (
            self.num_microbatches is None
            and isinstance(self.size, int)
            and isinstance(self.virtual_stages, int)
        ):
            # One micro-batch per stage: the fewest that keeps every schedule valid.
            object.__setattr__(self, "num_microbatches", self.size * self.virtual_stages)
        for field_name in ("size", "num_microbatches", "virtual_stages"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PipelinePlanError(
                    f"PipelinePlan.{field_name} must be a positive integer, got {value!r}"
                )
        if self.split_method not in SPLIT_METHODS:
            raise PipelinePlanError(
                f"PipelinePlan.split_method {self.split_method!r} is unknown; choose one of {SPLIT_METHODS}"
            )
        if self.schedule not in SCHEDULES:
            raise PipelinePlanError(
                f"PipelinePlan.schedule {self.schedule!r} is unknown; choose one of {SCHEDULES}"
            )
        self._check_split_points()
        self._check_schedule()

    @property
    def microbatch_count(self) -> int:
        """``num_microbatches`` after its default (the number of stages) is applied.

        Example::

            assert PipelinePlan(size=2, virtual_stages=2).microbatch_count == 4
        """
        if self.num_microbatches is None:  # __post_init__ sets it; None means it was bypassed
            raise PipelinePlanError(
                "PipelinePlan.num_microbatches is unset; build the plan with PipelinePlan(...) or "
                "PipelinePlan.from_dict(...), which default it to the number of stages"
            )
        return self.num_microbatches

    @property
    def num_stages(self) -> int:
        """The number of stages the model is cut into (``size * virtual_stages``)."""
        return self.size * self.virtual_stages

    def _check_split_points(self) -> None:
        if self.split_method == "manual":
            if len(self.split_points) != self.num_stages - 1:
                raise PipelinePlanError(
                    f"PipelinePlan has {self.num_stages} stages (size {self.size} x virtual_stages "
                    f"{self.virtual_stages}) and needs {self.num_stages - 1} split points, got "
                    f"{len(self.split_points)}: {list(self.split_points)}"
                )
            if not all(isinstance(fqn, str) and fqn for fqn in self.split_points):
                raise PipelinePlanError(
                    f"PipelinePlan.split_points must be module FQNs, got {list(self.split_points)}"
                )
        elif self.split_points:
            raise PipelinePlanError(
                f"PipelinePlan.split_points {list(self.split_points)} are given but split_method is "
                f"{self.split_method!r}; set split_method='manual' to cut at them, or drop them"
            )

    def _check_schedule(self) -> None:
        if self.schedule in _SINGLE_STAGE_SCHEDULES and self.virtual_stages != 1:
            raise PipelinePlanError(
                f"schedule {self.schedule!r} runs one stage per rank but virtual_stages is "
                f"{self.virtual_stages}; use 'interleaved_1f1b', 'zero_bubble' or 'zbv' for virtual stages"
            )
        if self.schedule == "zbv" and self.virtual_stages != 2:
            raise PipelinePlanError(
                f"schedule 'zbv' places exactly 2 stages per rank in a V; set virtual_stages=2, "
                f"got {self.virtual_stages}"
            )
        num_microbatches = self.microbatch_count
        if self.schedule == "1f1b" and num_microbatches < self.size:
            raise PipelinePlanError(
                f"schedule '1f1b' needs at least as many micro-batches as stages: num_microbatches="
                f"{self.num_microbatches} < size={self.size}; raise num_microbatches or use 'gpipe'"
            )
        if self.schedule in ("interleaved_1f1b", "zero_bubble"):
            rounds = max(1, num_microbatches // self.size)
            if num_microbatches % rounds:
                raise PipelinePlanError(
                    f"schedule {self.schedule!r} needs num_microbatches to be a multiple of the "
                    f"number of rounds ({rounds}); got {self.num_microbatches}. Use a multiple of "
                    f"size={self.size}"
                )

    def to_dict(self) -> dict[str, Any]:
        """This plan as JSON-ready builtins (``split_points`` as a list)."""
        as_dict = dataclasses.asdict(self)
        as_dict["split_points"] = list(self.split_points)
        return as_dict

    @classmethod
    def from_dict(cls, plan_dict: dict[str, Any]) -> PipelinePlan:
        """The plan that :meth:`to_dict` wrote; unknown keys are an error (they are typos)."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(plan_dict) - known)
        if unknown:
            raise PipelinePlanError(f"unknown PipelinePlan field(s) {unknown}; known fields: {sorted(known)}")
        if "size" not in plan_dict:
            raise PipelinePlanError("PipelinePlan needs 'size' (the pp mesh dimension)")
        return cls(**plan_dict)
