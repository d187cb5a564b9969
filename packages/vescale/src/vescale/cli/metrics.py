"""Rank 0's metrics: ``metrics.jsonl`` beside the checkpoints, TensorBoard scalars, and MFU.

One JSON object per logged step (``--log-every``): ``step``, ``loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``mfu``, ``max_memory_bytes``; one per evaluation: ``step``, ``eval_loss``,
``eval_perplexity``. ``--tensorboard DIR`` writes the same numbers as scalars (``train/loss``,
``train/tokens_per_s``, ``train/mfu``, ..., ``eval/loss``) through ``torch.utils.tensorboard``
(the ``tensorboard`` package: ``pip install 'vescale[tensorboard]'``). A resumed or restarted run
first drops the entries after the step it resumed from, so the file is the curve of one run.

MFU is the model's FLOPs per second over the devices' peak: ``6 N + 12 L h s`` FLOPs per token
(``N`` parameters without the input embedding, ``L`` layers, ``h`` hidden size, ``s`` sequence
length; forward and backward, PaLM's formula). The peak is the planner's hardware profile of
the device: a GPU's built-in profile, a CPU's calibrated one (:mod:`vescale.cli.hardware_peak`).

Example::

    with MetricsLog(Path("ckpt/metrics.jsonl"), tensorboard_dir=None, resumed_step=0) as metrics:
        metrics.write({"step": 25, "loss": 2.1, "tokens_per_s": 5000.0, "mfu": 0.12})
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vescale.cli.errors import CLIUsageError

__all__ = ["MetricsLog", "check_tensorboard_available", "flops_per_token", "max_memory_bytes"]


def check_tensorboard_available() -> None:
    """Raise a :class:`CLIUsageError` naming the extra when ``tensorboard`` is not installed.

    Example::

        check_tensorboard_available()   # before any rank starts
    """
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise CLIUsageError(
            "--tensorboard needs the tensorboard package: pip install 'vescale[tensorboard]'"
        ) from None


def flops_per_token(model: nn.Module, sequence_length: int) -> float:
    """Training FLOPs per token of ``model`` (forward + backward; see the module docstring).

    Works on a deferred (meta) model: only shapes are read.

    Example::

        flops_per_token(vescale.deferred_init(build), sequence_length=128)
    """
    parameters = sum(parameter.numel() for parameter in model.parameters())
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if isinstance(embeddings, nn.Module):
        parameters -= sum(parameter.numel() for parameter in embeddings.parameters())
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 6.0 * parameters + 12.0 * layers * hidden * sequence_length


def max_memory_bytes(device: torch.device) -> int:
    """The most memory this rank has held: CUDA allocations on a GPU, the peak resident set on CPU.

    Example::

        max_memory_bytes(torch.device("cpu"))
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MetricsLog:
    """Appends metric entries to ``metrics.jsonl`` (and TensorBoard); ``enabled=False`` writes nothing."""

    def __init__(
        self, path: Path, tensorboard_dir: str | None, resumed_step: int, *, enabled: bool = True
    ) -> None:
        self.path = path
        self.enabled = enabled
        self._writer = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resumed_step > 0 and path.is_file():
            entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            kept = [entry for entry in entries if entry.get("step", 0) <= resumed_step]
        elif path.is_file():
            path.unlink()
        if kept or resumed_step > 0:
            path.write_text("".join(json.dumps(entry) + "\n" for entry in kept))
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops the events a killed attempt wrote after the step resumed from.
            self._writer = SummaryWriter(
                tensorboard_dir, purge_step=resumed_step + 1 if resumed_step else None
            )

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._writer is not None:
            self._writer.close()

    def write(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` (with its ``step``) to the file and its numbers to TensorBoard."""
        if not self.enabled:
            return
        with open(self.path, "a") as stream:
            stream.write(json.dumps(entry) + "\n")
        if self._writer is not None:
            step = int(entry["step"])
            for name, value in entry.items():
                if name == "step" or value is None:
                    continue
                tag = f"eval/{name.removeprefix('eval_')}" if name.startswith("eval_") else f"train/{name}"
                self._writer.add_scalar(tag, float(value), step)
            self._writer.flush()
