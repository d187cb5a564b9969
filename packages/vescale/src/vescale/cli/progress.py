"""Rank 0's view of training: a ``rich`` progress bar with loss, tokens/s and ETA, and a log line
every few steps with the mean loss since the previous one (the bar redraws in a terminal; the
log lines stay, and are all a pipe sees: together they are the loss curve).

Example::

    with TrainingProgress(total_steps=100, first_step=0, tokens_per_step=2048) as progress:
        for step in range(100):
            progress.update(step, loss=2.3, step_seconds=0.4)
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

__all__ = ["TrainingProgress"]

_SPEED_WINDOW = 10


class TrainingProgress:
    """Progress of steps ``first_step .. first_step + total_steps``; ``enabled=False`` prints nothing.

    Tokens/s is the mean over the last few steps, the first step (compilation, warm-up) excluded.
    """

    def __init__(
        self,
        total_steps: int,
        first_step: int,
        tokens_per_step: int,
        *,
        enabled: bool = True,
        log_every: int = 25,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.first_step = first_step
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self.log_every = max(1, log_every)
        # MFU: the step's model FLOPs over the peak of all devices together.
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.mfu: float | None = None
        self.step_seconds: list[float] = []
        self._losses_since_line: list[float] = []
        self.console = Console()
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]} tok/s"),
            TextColumn("MFU {task.fields[mfu]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not enabled,
        )
        self._task = self._progress.add_task("train", total=total_steps, loss="-", speed="-", mfu="-")

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    @property
    def tokens_per_second(self) -> float:
        """Mean tokens/s over every step after the first (over the first alone when there is one step)."""
        measured = self.step_seconds[1:] or self.step_seconds
        return self.tokens_per_step * len(measured) / sum(measured) if measured else 0.0

    @property
    def recent_tokens_per_second(self) -> float:
        """Tokens/s over the last few steps (the first step excluded once there are others)."""
        recent = self.step_seconds[1:][-_SPEED_WINDOW:] or self.step_seconds
        return self.tokens_per_step * len(recent) / sum(recent) if recent else 0.0

    def logs(self, step: int) -> bool:
        """Whether global step ``step`` (0-based) gets a log line: every ``log_every``-th, first, last."""
        done = step + 1 - self.first_step
        return (step + 1) % self.log_every == 0 or done in (1, self.total_steps)

    def update(self, step: int, loss: float, step_seconds: float) -> None:
        """Record that global step ``step`` (0-based) finished with ``loss`` after ``step_seconds``."""
        self.step_seconds.append(step_seconds)
        recent = self.step_seconds[1:][-_SPEED_WINDOW:] or self.step_seconds
        speed = self.tokens_per_step * len(recent) / sum(recent)
        if self.flops_per_step and self.peak_flops:
            self.mfu = self.flops_per_step * len(recent) / sum(recent) / self.peak_flops
        mfu = "-" if self.mfu is None else f"{self.mfu:.1%}"
        self._progress.update(self._task, advance=1, loss=f"{loss:.4f}", speed=f"{speed:,.0f}", mfu=mfu)
        self._losses_since_line.append(loss)
        if self.enabled and self.logs(step):
            count = len(self._losses_since_line)
            mean = (
                f"  mean of last {count:>3} {sum(self._losses_since_line) / count:.4f}" if count > 1 else ""
            )
            self._progress.console.print(
                f"step {step + 1:>6}  loss {loss:.4f}{mean}  {speed:>9,.0f} tok/s  MFU {mfu}", highlight=False
            )
            self._losses_since_line.clear()
