"""``vescale train``: check the options, start the ranks with ``torch.distributed.run``, report.

The ranks run :mod:`vescale.cli.train_worker` under torch's own launcher (the machinery of
``torchrun``: elastic agent, rendezvous, worker monitoring), so ``--nnodes``, ``--node-rank`` and
``--rdzv-endpoint`` run the same command across machines. What can be checked before any rank
starts (model, data, constraints against the world size, checkpoint directory, ``--plot``) is
checked here; an error a rank meets later comes back through the run's error file as one line.

Example::

    vescale train                                 # tiny-llama on the pydoc topics, 4 local ranks
    vescale train --steps 50 --compare-single-device
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from vescale.cli.errors import USER_ERROR_EXIT_CODE, CLIUsageError
from vescale.cli.train_options import TrainOptions

__all__ = ["LaunchOptions", "torchrun_arguments", "train_command"]


@dataclass(frozen=True)
class LaunchOptions:
    """How to start the ranks: processes on this node, and torchrun's multi-node rendezvous flags."""

    nproc: int = 4
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks over all nodes."""
        return self.nproc * self.nnodes


def torchrun_arguments(options: TrainOptions, launch: LaunchOptions) -> list[str]:
    """The ``torchrun`` arguments that start :mod:`vescale.cli.train_worker` with ``options``.

    One node without an endpoint: ``--standalone`` (a local rendezvous on a free port). Several
    nodes: the static rendezvous at ``--rdzv-endpoint`` (node 0's address), as torchrun does.

    Example::

        torchrun_arguments(TrainOptions(), LaunchOptions(nproc=2))
    """
    arguments = ["--nproc-per-node", str(launch.nproc), "--max-restarts", "0"]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        arguments.append("--standalone")
    else:
        arguments += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
        arguments += ["--rdzv-endpoint", launch.rdzv_endpoint or ""]
    return [*arguments, "-m", "vescale.cli.train_worker", options.to_json()]


def _check_options(options: TrainOptions, launch: LaunchOptions, compare: bool, plot: Path | None) -> None:
    if options.steps < 1:
        raise CLIUsageError(f"--steps {options.steps}: train at least 1 step")
    if launch.nproc < 1 or launch.nnodes < 1:
        raise CLIUsageError(f"--nproc {launch.nproc} and --nnodes {launch.nnodes} must be at least 1")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise CLIUsageError(f"--nnodes {launch.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if not 0 <= launch.node_rank < launch.nnodes:
        raise CLIUsageError(f"--node-rank {launch.node_rank} must be in [0, {launch.nnodes})")
    if compare and options.resume:
        raise CLIUsageError(
            "--compare-single-device trains the reference from the seed, not from a checkpoint; "
            "drop --resume or --compare-single-device"
        )
    if plot is not None:
        from vescale.cli.plot import check_plot_available

        check_plot_available()
    checkpoint_dir = Path(options.checkpoint_dir)
    holds_checkpoint = (checkpoint_dir / "latest").is_file()
    if options.resume and not holds_checkpoint:
        raise CLIUsageError(
            f"--resume: {checkpoint_dir} holds no checkpoint; train without --resume first, "
            "or pass the --checkpoint-dir of an earlier run"
        )
    if not options.resume and holds_checkpoint:
        raise CLIUsageError(
            f"{checkpoint_dir} already holds a checkpoint; pass --resume to continue it, or another "
            "--checkpoint-dir to start a new run"
        )
    # The cheap checks above first; these import torch and transformers.
    from vescale.cli.data import read_text
    from vescale.cli.models import resolve_model
    from vescale.cli.recipe import default_constraints
    from vescale.planner import Constraints

    Constraints.from_dict(default_constraints(options.constraints, launch.world_size)).check_world_size(
        launch.world_size
    )
    resolve_model(options.model)
    read_text(options.data)


def _launch(options: TrainOptions, launch: LaunchOptions) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Threads per rank: the node's cores shared by its ranks (torchrun's own default is 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // launch.nproc)))
    # The agent logs every failed rank; the error file (or the rank's own traceback) says it better.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(torchrun_arguments(options, launch)))
    except ChildFailedError as failure:
        error_file = Path(options.error_file) if options.error_file else None
        if error_file is not None and error_file.is_file():
            print(error_file.read_text().strip(), file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)
        rank, first = failure.get_first_failure()
        print(
            f"error: training failed on rank {rank} (exit code {first.exitcode}); its traceback is above",
            file=sys.stderr,
        )
        sys.exit(1)


def _compare(options: TrainOptions, plot: Path | None, compare: bool) -> None:
    history = json.loads(options.losses_file.read_text())
    parallel = history["losses"][-options.steps :]
    reference = None
    if compare:
        from vescale.cli.comparison import comparison_table
        from vescale.cli.reference import reference_losses
        from vescale.cli.run_layout import RunLayout

        layout = RunLayout.from_dict(history["layout"])
        print(
            f"single-device reference: {options.steps} steps in one process (float32, "
            f"{layout.threads_per_rank} thread(s) as each rank)...",
            flush=True,
        )
        reference = reference_losses(options, layout)
        print(comparison_table(parallel, reference, layout))
    if plot is not None:
        from vescale.cli.plot import plot_losses

        plot_losses(plot, parallel, reference)
        print(f"loss curves drawn to {plot}")


def train_command(options: TrainOptions, launch: LaunchOptions, *, compare: bool, plot: Path | None) -> None:
    """Train ``options`` on ``launch.world_size`` ranks, then compare with one device when asked.

    Example::

        train_command(TrainOptions(steps=20), LaunchOptions(nproc=2), compare=True, plot=None)
    """
    _check_options(options, launch, compare, plot)
    if compare:
        # Rank-ordered gradient sums: the order the single-device reference can repeat exactly.
        options = replace(options, deterministic=True)
    with tempfile.TemporaryDirectory(prefix="vescale-train-") as run_dir:
        _launch(replace(options, error_file=str(Path(run_dir) / "error.txt")), launch)
    if launch.node_rank == 0 and (compare or plot is not None):
        _compare(options, plot, compare)
