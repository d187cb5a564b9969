"""The ``"performance"`` section of a plan: the predicted step time, its breakdown, and the runners-up.

:mod:`vescale.planner.cost` predicts it; the plan carries it as plain data so that it round-trips
through JSON with the rest. Model FLOPs count the model's forward and backward (``6 N`` per token
plus attention), never recomputation, so MFU compares plans fairly.

Example::

    performance = plan.performance
    print(performance.step_time_s, performance.mfu, dict(performance.breakdown))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vescale.planner.errors import PlanError

__all__ = ["Performance", "RunnerUp"]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise PlanError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def _breakdown(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, dict | tuple | list):
        raise PlanError(f"{where} must be an object of part -> seconds")
    items = value.items() if isinstance(value, dict) else value
    return tuple((str(name), _number(seconds, f"{where}.{name}")) for name, seconds in items)


@dataclass(frozen=True)
class RunnerUp:
    """A plan the search ranked below the chosen one: what it was, its predicted time, why it lost.

    Example::

        RunnerUp("pp1 dp8 tp1 zero3 bf16 mbs2 ac=selective", 1.9, (("compute", 1.5),), "12% slower")
    """

    choice: str
    step_time_s: float
    breakdown: tuple[tuple[str, float], ...]
    lost_because: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_time_s", _number(self.step_time_s, "runner_up.step_time_s"))
        object.__setattr__(self, "breakdown", _breakdown(self.breakdown, "runner_up.breakdown"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready builtins."""
        return {**dataclasses.asdict(self), "breakdown": dict(self.breakdown)}

    @classmethod
    def from_dict(cls, runner_up: Any) -> RunnerUp:
        """What :meth:`to_dict` wrote."""
        names = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(runner_up, dict) or sorted(runner_up) != sorted(names):
            raise PlanError(f"a runner-up is an object with exactly the keys {names}, got {runner_up!r}")
        return cls(**runner_up)


@dataclass(frozen=True)
class Performance:
    """Predicted speed of one training step on ``hardware`` (see the module docstring).

    Example::

        Performance("h100-80gb", 2.0, 65536.0, 400.0, 0.4, (("compute", 1.6), ("bubble", 0.4)))
    """

    hardware: str
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_device: float
    mfu: float
    breakdown: tuple[tuple[str, float], ...]
    runners_up: tuple[RunnerUp, ...] = ()

    def __post_init__(self) -> None:
        for name in ("step_time_s", "tokens_per_s", "model_tflops_per_device", "mfu"):
            object.__setattr__(self, name, _number(getattr(self, name), f"performance.{name}"))
        object.__setattr__(self, "breakdown", _breakdown(self.breakdown, "performance.breakdown"))
        object.__setattr__(self, "runners_up", tuple(self.runners_up))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready builtins: the issue's ``{"hardware", "step_time_s", ..., "breakdown": {...}}``."""
        return {
            "hardware": self.hardware,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_device": self.model_tflops_per_device,
            "mfu": self.mfu,
            "breakdown": dict(self.breakdown),
            "runners_up": [runner_up.to_dict() for runner_up in self.runners_up],
        }

    @classmethod
    def from_dict(cls, performance: Any) -> Performance:
        """What :meth:`to_dict` wrote; a bad field raises ``PlanError`` naming it."""
        names = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(performance, dict):
            raise PlanError(f"performance must be an object with the keys {names}")
        unknown = sorted(set(performance) - set(names))
        missing = sorted(set(names) - set(performance) - {"runners_up"})
        if unknown or missing:
            raise PlanError(
                f"performance has unknown key(s) {unknown} / lacks {missing}; the keys are {names}"
            )
        runners_up = performance.get("runners_up") or []
        if not isinstance(runners_up, list):
            raise PlanError("performance.runners_up must be a list")
        return cls(**{**performance, "runners_up": tuple(RunnerUp.from_dict(item) for item in runners_up)})
