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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from vescale.cli.errors import USER_ERROR_EXIT_CODE, CLIUsageError
from vescale.cli.restart_reports import RestartReporter, UserErrorStop, describe_exit
from vescale.cli.run_checkpoints import newest_checkpoint
from vescale.cli.text_corpus import copy_tokenizer_files, tokenizer_file
from vescale.cli.train_options import ERROR_FILE_NAME, TrainOptions

__all__ = ["LaunchOptions", "torchrun_arguments", "train_command"]


@dataclass(frozen=True)
class LaunchOptions:
    """How to start the ranks: processes on this node, and torchrun's multi-node rendezvous flags."""

    nproc: int = 4
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 0

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
    arguments = ["--nproc-per-node", str(launch.nproc), "--max-restarts", str(launch.max_restarts)]
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
    _check_run_options(options, launch)
    if compare and options.resume:
        raise CLIUsageError(
            "--compare-single-device trains the reference from the seed, not from a checkpoint; "
            "drop --resume or --compare-single-device"
        )
    if plot is not None:
        from vescale.cli.plot import check_plot_available

        check_plot_available()
    checkpoint_dir = Path(options.checkpoint_dir)
    holds_checkpoint = (checkpoint_dir / "latest").is_file() or newest_checkpoint(checkpoint_dir) is not None
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
    from vescale.cli.data import training_tokens
    from vescale.cli.models import resolve_model
    from vescale.cli.recipe import default_constraints, split_deterministic
    from vescale.planner import Constraints

    constraints, _ = split_deterministic(options.constraints)
    Constraints.from_dict(default_constraints(constraints, launch.world_size)).check_world_size(
        launch.world_size
    )
    source = resolve_model(options.model)
    # Tokenized here, once: the ranks (and every restart) read the cache beside the data.
    eos = getattr(source.config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    training_tokens(
        options.data,
        tokenizer_file(options.tokenizer, options.model),
        options.text_field,
        eos if isinstance(eos, int) else None,
    )


def _check_run_options(options: TrainOptions, launch: LaunchOptions) -> None:
    for flag, value in (("--save-every", options.save_every), ("--max-restarts", launch.max_restarts)):
        if value < 0:
            raise CLIUsageError(f"{flag} {value} must be at least 0")
    if options.keep_last is not None and options.keep_last < 1:
        raise CLIUsageError(f"--keep-last {options.keep_last}: keep at least the newest checkpoint (>= 1)")
    if options.log_every < 1 or options.eval_every < 0:
        raise CLIUsageError(f"--log-every {options.log_every} must be >= 1 and --eval-every >= 0")
    if launch.max_restarts > 0 and options.save_every == 0:
        raise CLIUsageError(
            f"--max-restarts {launch.max_restarts} resumes from the newest periodic checkpoint; "
            "pass --save-every N too, or a restart would start again from step 0"
        )
    if options.tensorboard is not None:
        from vescale.cli.metrics import check_tensorboard_available

        check_tensorboard_available()


def _launch(options: TrainOptions, launch: LaunchOptions, run_dir: Path) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Threads per rank: the node's cores shared by its ranks (torchrun's own default is 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // launch.nproc)))
    # The agent logs every failed rank; the error file (or the rank's own traceback) says it better.
    # Its failure and restart records become one line per failed attempt (RestartReporter).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    reporter = RestartReporter(launch.node_rank, launch.nproc, launch.max_restarts, run_dir)
    try:
        with reporter.listening():
            # torch leaves torchrun's entry points unannotated: typed here.
            parse_args = cast(Callable[[list[str]], Any], torchrun.parse_args)
            cast(Callable[[Any], None], torchrun.run)(parse_args(torchrun_arguments(options, launch)))
    except UserErrorStop as stop:  # a rank's user error: the next attempt would meet it again
        print(str(stop), file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    except ChildFailedError as failure:
        error_file = reporter.error_file
        if error_file is not None and error_file.is_file():
            print(error_file.read_text().strip(), file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)
        rank, first = failure.get_first_failure()
        attempts = (
            f" in attempt {reporter.attempt} of {launch.max_restarts + 1}" if launch.max_restarts else ""
        )
        print(
            f"error: training failed on rank {rank}{attempts}: it {describe_exit(first.exitcode)}",
            file=sys.stderr,
        )
        sys.exit(1)


def _cpu_peak_flops(launch: LaunchOptions) -> float | None:
    """MFU's denominator on CPU ranks: the planner's calibrated cpu profile (rank 0's node measures it)."""
    import torch

    if launch.node_rank != 0 or torch.cuda.is_available():
        return None
    from vescale.cli.hardware_peak import calibrated_cpu_peak

    return calibrated_cpu_peak(launch.nproc)[0]


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
    tokenizer = tokenizer_file(options.tokenizer, options.model)
    if tokenizer is not None and launch.node_rank == 0:  # kept with the run: export-hf copies them on
        copy_tokenizer_files(tokenizer, Path(options.checkpoint_dir))
    if options.resume:  # --steps more steps after the newest checkpoint, however often the ranks restart
        found = newest_checkpoint(Path(options.checkpoint_dir))
        options = replace(options, start_step=found[0] if found is not None else 0)
    options = replace(options, cpu_peak_flops=_cpu_peak_flops(launch))
    if compare:
        # Rank-ordered gradient sums: the order the single-device reference can repeat exactly.
        options = replace(options, deterministic=True)
    with tempfile.TemporaryDirectory(prefix="vescale-train-") as run_dir:
        _launch(replace(options, error_file=str(Path(run_dir) / ERROR_FILE_NAME)), launch, Path(run_dir))
    if launch.node_rank == 0 and (compare or plot is not None):
        _compare(options, plot, compare)
