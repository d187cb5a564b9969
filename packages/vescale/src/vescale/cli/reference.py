"""``--compare-single-device``: the same training on one process, in plain PyTorch, beside veScale's.

The reference builds the model eagerly after ``torch.manual_seed(seed)`` (what
``vescale.manual_seed`` + ``vescale.deferred_init`` reproduce), uses the same optimizer and
schedule (:mod:`vescale.cli.recipe`) and the global batches ``torch.utils.data.DataLoader``
yields without shuffling (the ones ``vescale.DistributedDataLoader`` splits over the ranks).

Example::

    reference = reference_losses(options, global_batch_size=16, sequence_length=128)
    print(comparison_table(parallel_losses, reference))
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from vescale.cli.data import ByteTextDataset, read_text
from vescale.cli.errors import CLIUsageError
from vescale.cli.models import resolve_model
from vescale.cli.recipe import make_lr_scheduler, make_optimizer
from vescale.cli.train_options import TrainOptions

__all__ = [
    "AGREEMENT_RTOL",
    "check_plot_available",
    "comparison_table",
    "max_relative_difference",
    "plot_losses",
    "reference_losses",
]


AGREEMENT_RTOL = 1e-4
"""The relative difference of the loss curves that ``vescale train`` reports against (issue #9)."""


def reference_losses(options: TrainOptions, global_batch_size: int, sequence_length: int) -> list[float]:
    """The loss of each of ``options.steps`` steps of single-process float32 training.

    Example::

        losses = reference_losses(TrainOptions(steps=5), global_batch_size=16, sequence_length=128)
    """
    torch.manual_seed(options.seed)
    model = resolve_model(options.model).build()
    optimizer = make_optimizer(model, options.learning_rate)
    scheduler = make_lr_scheduler(optimizer)
    dataset = ByteTextDataset(read_text(options.data), sequence_length, options.seed)
    loader = DataLoader(dataset, batch_size=global_batch_size, shuffle=False, drop_last=True)
    losses: list[float] = []
    batches = iter(loader)
    for _ in range(options.steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses


def max_relative_difference(parallel: list[float], reference: list[float]) -> float:
    """``max |parallel - reference| / max |reference|`` over the steps (the guide's relative error).

    Example::

        max_relative_difference([2.0, 1.5], [2.0, 1.5])   # 0.0
    """
    scale = max(abs(value) for value in reference)
    return max(abs(p - r) for p, r in zip(parallel, reference, strict=True)) / scale


def comparison_table(parallel: list[float], reference: list[float], rows: int = 20) -> str:
    """Both loss curves side by side (about ``rows`` evenly spaced steps) and their largest difference.

    Example::

        print(comparison_table(parallel_losses, reference_losses))
    """
    every = max(1, len(reference) // rows)
    shown = sorted({*range(0, len(reference), every), len(reference) - 1})
    lines = [f"{'step':>6}  {'vescale':>12}  {'single device':>13}  {'rel. diff':>9}", "-" * 46]
    for index in shown:
        difference = abs(parallel[index] - reference[index]) / abs(reference[index])
        lines.append(
            f"{index + 1:>6}  {parallel[index]:>12.6f}  {reference[index]:>13.6f}  {difference:>9.1e}"
        )
    lines.append(
        f"max relative difference over {len(reference)} steps: "
        f"{max_relative_difference(parallel, reference):.2e}"
    )
    # Rounding differences (the order of the gradient all-reduce's sums) are amplified by training
    # itself; this is the step from which they show at the 1e-4 bound.
    beyond = next(
        (
            step
            for step in range(1, len(reference) + 1)
            if max_relative_difference(parallel[:step], reference[:step]) > AGREEMENT_RTOL
        ),
        None,
    )
    if beyond is None:
        lines.append(f"the curves agree within {AGREEMENT_RTOL:.0e} relative at every step")
    else:
        lines.append(f"the curves agree within {AGREEMENT_RTOL:.0e} relative up to step {beyond - 1}")
    return "\n".join(lines)


def check_plot_available() -> None:
    """Raise ``CLIUsageError`` when ``--plot`` cannot work: matplotlib is not installed.

    Example::

        check_plot_available()   # before training starts, not after
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise CLIUsageError(
            "--plot needs matplotlib, which is not installed; pip install matplotlib, or drop --plot"
        )


def plot_losses(path: Path, parallel: list[float], reference: list[float] | None) -> None:
    """Draw the loss curve(s) into the image file ``path`` (the format follows its suffix).

    Example::

        plot_losses(Path("loss.png"), parallel_losses, reference_losses)
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4))
    steps = range(1, len(parallel) + 1)
    axes.plot(steps, parallel, label="vescale")
    if reference is not None:
        axes.plot(steps, reference, label="single device", linestyle="--")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
