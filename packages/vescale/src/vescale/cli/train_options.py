"""The options of one ``vescale train`` run, as the launcher hands them to every rank (JSON).

Example::

    options = TrainOptions(model="tiny-llama", steps=20, checkpoint_dir="ckpt/tiny-llama")
    TrainOptions.from_json(options.to_json()) == options
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ERROR_FILE_NAME", "LOSSES_FILE_NAME", "METRICS_FILE_NAME", "STALL_FILE_NAME", "TrainOptions"]

LOSSES_FILE_NAME = "losses.json"
"""Rank 0 keeps the loss curve of a run (all its resumed parts) beside its checkpoints."""
METRICS_FILE_NAME = "metrics.jsonl"
"""Rank 0 appends one JSON object per logged step (and per evaluation) beside the checkpoints."""
ERROR_FILE_NAME = "error.txt"
"""In the launch's own directory: the first rank that meets a user error writes its one line there."""
STALL_FILE_NAME = "stalled"
"""In the launch's own directory: a rank's watchdog creates it when a step outlived ``--timeout``."""


@dataclass(frozen=True)
class TrainOptions:
    """What every rank needs to run the training loop; the launcher checks them first.

    ``deterministic``: sum the data-parallel gradients in rank order (``--compare-single-device``
    sets it, so that one process can repeat the sums). ``error_file``: where the first rank that
    meets a user error writes its one-line message. ``start_step``: the step the launch resumed
    from (0 for a new run); the run ends at ``start_step + steps`` however often it restarts.
    ``save_every``: an async checkpoint every that many steps (0: only at the end).
    ``timeout_s``: a step (its collectives included) that takes longer fails the attempt with
    every rank's Python stack. ``cpu_peak_flops``: one CPU rank's float32 FLOP/s per thread from the
    planner's calibrated profile (the launcher measures it; MFU's denominator on CPU).
    """

    model: str = "tiny-llama"
    data: str | None = None
    steps: int = 500
    constraints: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: str = "vescale_checkpoints/tiny-llama"
    resume: bool = False
    compile: bool = False
    seed: int = 0
    learning_rate: float = 3e-3
    deterministic: bool = False
    error_file: str | None = None
    start_step: int = 0
    save_every: int = 0
    keep_last: int | None = None
    timeout_s: float = 600.0
    log_every: int = 25
    tensorboard: str | None = None
    tokenizer: str | None = None
    text_field: str = "text"
    eval_every: int = 0
    eval_fraction: float = 0.05
    cpu_peak_flops: float | None = None

    @property
    def end_step(self) -> int:
        """The step the run ends at, across resumes and restarts."""
        return self.start_step + self.steps

    @property
    def stall_file(self) -> Path | None:
        """Beside the error file: the watchdog's mark that a step stalled (the launcher then dumps stacks)."""
        return Path(self.error_file).with_name(STALL_FILE_NAME) if self.error_file else None

    @property
    def metrics_file(self) -> Path:
        """The run's ``metrics.jsonl``: one object per logged step and per evaluation."""
        return Path(self.checkpoint_dir) / METRICS_FILE_NAME

    @property
    def losses_file(self) -> Path:
        """The JSON loss curve of this run: ``{"steps": [...], "losses": [...], ...}``."""
        return Path(self.checkpoint_dir) / LOSSES_FILE_NAME

    def to_json(self) -> str:
        """The options as one JSON line (a command-line argument of each rank)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainOptions:
        """The options :meth:`to_json` wrote."""
        return cls(**json.loads(text))
