"""The ``vescale`` command's options and help (``typer``); each command's work lives in its own module.

Example::

    vescale --help
    vescale plan --model llama-3-70b --world-size 1024
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vescale.cli.errors import reported_errors

__all__ = ["app", "checkpoint_app"]

app = typer.Typer(
    name="vescale",
    help="veScale: train a single-device PyTorch model on many devices as if on one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
checkpoint_app = typer.Typer(
    help="Read a checkpoint: inspect it, or export it for Hugging Face.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(checkpoint_app, name="checkpoint")

_MODEL_HELP = (
    "A preset (tiny-llama, llama-7b, llama-3-70b, gpt2, mixtral-tiny), a transformers config.json "
    "(or its directory), or module:Class (a module class, a function returning one, or a config)."
)
_CONSTRAINTS_HELP = "Planner constraints as JSON, e.g. '{\"tensor_parallel.size\": 2}', or a JSON file."


@app.command()
def train(
    model: Annotated[str, typer.Option(help=_MODEL_HELP)] = "tiny-llama",
    data: Annotated[
        str | None,
        typer.Option(
            help=(
                "Text to train on: .txt, .jsonl (--text-field), .parquet, or a `datasets` directory. "
                "Default: Python's pydoc topics, byte by byte."
            )
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="A Hugging Face tokenizers tokenizer.json (default: the --model directory's, else bytes)."
        ),
    ] = None,
    text_field: Annotated[
        str, typer.Option(help="The text's field in .jsonl/.parquet/datasets data.")
    ] = "text",
    nproc: Annotated[int, typer.Option(help="Processes (ranks) on this node.")] = 4,
    steps: Annotated[
        int,
        typer.Option(
            help="Optimizer steps to run (after the resumed ones with --resume); restarts end there too."
        ),
    ] = 500,
    constraints: Annotated[str | None, typer.Option(help=_CONSTRAINTS_HELP)] = None,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(help="Where checkpoints go. Default: ./vescale_checkpoints/MODEL (the --model name)."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run saved in --checkpoint-dir.")
    ] = False,
    compile: Annotated[bool, typer.Option("--compile", help="Run the model under torch.compile.")] = False,
    compare_single_device: Annotated[
        bool,
        typer.Option(
            "--compare-single-device",
            help=(
                "Sum the data-parallel gradients in rank order, also train on one process repeating those "
                "sums, and print both loss curves side by side and how far they agree."
            ),
        ),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(help="Draw the loss curve(s) into this image (matplotlib: the vescale[plot] extra)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the model's initialisation.")] = 0,
    learning_rate: Annotated[
        float, typer.Option(help="AdamW's learning rate (after a 10-step warm-up).")
    ] = 3e-3,
    nnodes: Annotated[
        int, typer.Option(help="Nodes (torchrun --nnodes); the same command runs on each.")
    ] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's rank (torchrun --node-rank).")] = 0,
    rdzv_endpoint: Annotated[
        str | None, typer.Option(help="HOST:PORT of node 0 for the rendezvous (torchrun --rdzv-endpoint).")
    ] = None,
    save_every: Annotated[
        int, typer.Option(help="Save an async checkpoint every N steps (0: only at the end).")
    ] = 0,
    keep_last: Annotated[
        int | None, typer.Option(help="Keep only the K newest complete checkpoints.")
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option(
            help="Restart every rank up to R times when one dies or hangs, from the newest checkpoint."
        ),
    ] = 0,
    timeout: Annotated[
        float,
        typer.Option(
            help="Fail the attempt, with every rank's Python stack, when a step takes longer (s; 0: off)."
        ),
    ] = 600.0,
    log_every: Annotated[int, typer.Option(help="A log line and a metrics.jsonl entry every N steps.")] = 25,
    tensorboard: Annotated[
        Path | None,
        typer.Option(help="Also write the metrics as TensorBoard scalars here (vescale[tensorboard])."),
    ] = None,
    eval_every: Annotated[
        int, typer.Option(help="Evaluate the held-out split every N steps (0: no held-out split).")
    ] = 0,
    eval_fraction: Annotated[
        float, typer.Option(help="The fraction of the samples held out for --eval-every.")
    ] = 0.05,
) -> None:
    """Train a model on local processes started by torch's launcher: the plan, a progress bar, a checkpoint.

    With no options: a small Llama-style model learns the standard library's pydoc topics byte
    by byte on 4 CPU processes (nothing is downloaded).
    """
    from vescale.cli.train_command import LaunchOptions, train_command
    from vescale.cli.train_options import TrainOptions

    with reported_errors():
        from vescale.cli.constraints_input import parse_constraints

        options = TrainOptions(
            model=model,
            data=data,
            steps=steps,
            constraints=parse_constraints(constraints),
            checkpoint_dir=str(checkpoint_dir or Path("vescale_checkpoints") / _run_name(model)),
            resume=resume,
            compile=compile,
            seed=seed,
            learning_rate=learning_rate,
            tokenizer=tokenizer,
            text_field=text_field,
            save_every=save_every,
            keep_last=keep_last,
            timeout_s=timeout,
            log_every=log_every,
            tensorboard=str(tensorboard) if tensorboard is not None else None,
            eval_every=eval_every,
            eval_fraction=eval_fraction,
        )
        launch = LaunchOptions(
            nproc=nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            rdzv_endpoint=rdzv_endpoint,
            max_restarts=max_restarts,
        )
        train_command(options, launch, compare=compare_single_device, plot=plot)


def _run_name(model: str) -> str:
    # A preset keeps its name; a path or module:Class its last part, safe as a directory name.
    last = Path(model.replace(":", "/")).stem or "model"
    return "".join(char if char.isalnum() or char in "-_." else "_" for char in last)


@app.command()
def plan(
    model: Annotated[str, typer.Option(help=_MODEL_HELP)] = "tiny-llama",
    world_size: Annotated[
        int | None, typer.Option(help="Devices to plan for (default 8, or --nodes x devices per node).")
    ] = None,
    constraints: Annotated[str | None, typer.Option(help=_CONSTRAINTS_HELP)] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the plan as editable JSON here.")
    ] = None,
    explain: Annotated[
        bool, typer.Option("--explain/--no-explain", help="Print why each choice was made.")
    ] = True,
    hardware: Annotated[
        str | None,
        typer.Option(
            help="A hardware profile (h100-80gb, h200-141gb, a100-80gb, a100-40gb, cpu, or a JSON file): "
            "the plan is then the fastest predicted one, with step time, tokens/s and MFU."
        ),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option(help="Nodes to plan for: the world is nodes x devices per node.")
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Runners-up to list with their breakdowns.")] = 3,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate", help="Time matmuls and gloo collectives here, write a cpu profile, use it."
        ),
    ] = False,
    profile_out: Annotated[
        Path, typer.Option(help="Where --calibrate writes the measured profile (JSON).")
    ] = Path("vescale-cpu-profile.json"),
) -> None:
    """Print the parallel plan, its memory estimate and (with a hardware profile) its predicted speed
    for a model on N devices (meta tensors: nothing runs)."""
    from vescale.cli.plan_command import plan_command

    with reported_errors():
        plan_command(
            model,
            world_size,
            constraints,
            json_path,
            explain,
            hardware=hardware,
            nodes=nodes,
            top=top,
            calibrate=calibrate,
            profile_out=profile_out,
        )


@checkpoint_app.command("inspect")
def inspect_checkpoint(
    path: Annotated[
        Path, typer.Argument(help="A checkpoint directory, or the directory holding its 'latest'.")
    ],
) -> None:
    """List a checkpoint's tensors (global shapes, saved placements, sizes) and the plan it was saved with."""
    from rich.console import Console

    from vescale.cli.checkpoint_commands import inspect_command

    with reported_errors():
        inspect_command(path, Console())


@checkpoint_app.command("export-hf")
def export_hf(
    path: Annotated[
        Path, typer.Argument(help="A checkpoint directory, or the directory holding its 'latest'.")
    ],
    out: Annotated[Path, typer.Argument(help="The Hugging Face directory to write (safetensors).")],
    prefix: Annotated[str, typer.Option(help="The state key the model was saved under.")] = "model",
) -> None:
    """Write a checkpoint's model as a consolidated Hugging Face safetensors checkpoint."""
    from rich.console import Console

    from vescale.cli.checkpoint_commands import export_hf_command

    with reported_errors():
        export_hf_command(path, out, prefix, Console())
