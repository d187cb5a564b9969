"""``--plot FILE``: the loss curve(s) of a run drawn with matplotlib (the ``vescale[plot]`` extra).

Example::

    check_plot_available()                 # before training starts, not after
    plot_losses(Path("loss.png"), parallel_losses, reference_losses)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vescale.cli.errors import CLIUsageError

__all__ = ["check_plot_available", "plot_losses"]


def check_plot_available() -> None:
    """Raise ``CLIUsageError`` when ``--plot`` cannot work: matplotlib is not installed.

    Example::

        check_plot_available()   # before training starts, not after
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise CLIUsageError(
            "--plot needs matplotlib, which is not installed; pip install 'vescale[plot]' "
            "(or pip install matplotlib), or drop --plot"
        )


def plot_losses(path: Path, parallel: list[float], reference: list[float] | None) -> None:
    """Draw the loss curve(s) into the image file ``path`` (the format follows its suffix).

    Example::

        plot_losses(Path("loss.png"), parallel_losses, reference_losses)
    """
    import matplotlib

    # No display is needed (ranks, CI, ssh): the file is the output.
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
