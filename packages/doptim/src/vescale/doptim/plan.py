"""The data-parallel section of a veScale plan: how many replicas, which ZeRO stage, how gradients move.

The planner assembles one :class:`DataParallelPlan` into its ``Plan``; it round-trips through
JSON exactly (``to_dict``/``from_dict``), so a user can edit it by hand. The fields are the
arguments of :func:`~vescale.doptim.data_parallel` and of :class:`~vescale.doptim.DDP`.

Example::

    plan = DataParallelPlan(size=4, zero_stage=1, mixed_precision="bf16")
    assert DataParallelPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vescale.doptim.data_parallel import ZERO_STAGES
from vescale.doptim.errors import DataParallelConfigError

__all__ = ["MIXED_PRECISIONS", "DataParallelPlan"]

# "bf16": parameters and gradients in bfloat16, fp32 master weights and optimizer state.
MIXED_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class DataParallelPlan:
    """The ``dp`` mesh dimension's size and how the optimizer state and gradients are kept on it.

    ``zero_stage`` shards the optimizer state (1), plus the gradients (2), plus the parameters
    (3, FSDP2). ``bucket_size_mb`` sizes the gradient buckets of stages 0-2 (stage 3 has none,
    so it takes only the default); ``deterministic`` works in every stage.

    Example::

        plan = DataParallelPlan(size=2, zero_stage=2, deterministic=True)
        assert plan.shards_gradients
    """

    size: int
    zero_stage: int = 0
    bucket_size_mb: float = 25.0
    deterministic: bool = False
    mixed_precision: str = "fp32"

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise DataParallelConfigError(
                f"DataParallelPlan.size must be a positive integer, got {self.size!r}"
            )
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise DataParallelConfigError(
                f"DataParallelPlan.zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}"
            )
        bucket = self.bucket_size_mb
        if isinstance(bucket, bool) or not isinstance(bucket, int | float) or not bucket > 0:
            raise DataParallelConfigError(
                f"DataParallelPlan.bucket_size_mb must be a positive number of MiB, got {bucket!r}"
            )
        # JSON may give 25 for 25.0; keep one type so that a round trip compares equal.
        object.__setattr__(self, "bucket_size_mb", float(bucket))
        if not isinstance(self.deterministic, bool):
            raise DataParallelConfigError(
                f"DataParallelPlan.deterministic must be true or false, got {self.deterministic!r}"
            )
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise DataParallelConfigError(
                f"DataParallelPlan.mixed_precision {self.mixed_precision!r} is unknown; choose one of "
                f"{MIXED_PRECISIONS}"
            )
        if self.zero_stage == 3 and self.bucket_size_mb != 25.0:
            raise DataParallelConfigError(
                "DataParallelPlan.zero_stage=3 runs on FSDP2, which has no gradient buckets; "
                "drop bucket_size_mb or use zero_stage<=2"
            )

    @property
    def shards_optimizer_state(self) -> bool:
        """Whether each dp rank keeps only its share of the optimizer state (ZeRO >= 1)."""
        return self.zero_stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Whether each dp rank keeps only its share of the gradients (ZeRO >= 2)."""
        return self.zero_stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """Whether each dp rank keeps only its share of the parameters (ZeRO-3)."""
        return self.zero_stage == 3

    def to_dict(self) -> dict[str, Any]:
        """This plan as JSON-ready builtins.

        Example::

            DataParallelPlan(size=2).to_dict()["zero_stage"]   # 0
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, plan_dict: dict[str, Any]) -> DataParallelPlan:
        """The plan that :meth:`to_dict` wrote; unknown keys are an error (they are typos).

        Example::

            DataParallelPlan.from_dict({"size": 4, "zero_stage": 2})
        """
        if not isinstance(plan_dict, dict):
            raise DataParallelConfigError(
                "a DataParallelPlan is a dict like {'size': 2, 'zero_stage': 1}, got "
                f"{type(plan_dict).__name__}"
            )
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(plan_dict) - set(known))
        if unknown:
            raise DataParallelConfigError(
                f"unknown DataParallelPlan field(s) {unknown}; known fields: {known}"
            )
        if "size" not in plan_dict:
            raise DataParallelConfigError("DataParallelPlan needs 'size' (the dp mesh dimension)")
        return cls(**plan_dict)
