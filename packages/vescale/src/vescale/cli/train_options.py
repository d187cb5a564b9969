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

__all__ = ["LOSSES_FILE_NAME", "TrainOptions"]

LOSSES_FILE_NAME = "losses.json"
"""Rank 0 keeps the loss curve of a run (all its resumed parts) beside its checkpoints."""


@dataclass(frozen=True)
class TrainOptions:
    """What every rank needs to run the training loop; the launcher checks them first.

    ``deterministic``: sum the data-parallel gradients in rank order (``--compare-single-device``
    sets it, so that one process can repeat the sums). ``error_file``: where the first rank that
    meets a user error writes its one-line message.
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
