"""One rank of ``vescale train``: the training script a user would write with veScale's five calls.

``vescale train`` starts this module on every rank through ``torch.distributed.run``; it reads the
run's :class:`~vescale.cli.train_options.TrainOptions` (JSON, the one argument), builds the model
with ``vescale.deferred_init``, plans it with ``vescale.generate_plan``, applies the plan with
``vescale.parallelize``, trains, and saves with ``vescale.save`` (``--resume``: ``vescale.load``).
Rank 0 prints the plan and the progress. A user error (a constraint the world size cannot meet,
a checkpoint that does not fit) is written once to the run's error file and every rank exits with
status 2, so the launcher prints one line instead of a traceback per rank.

Example::

    python -m torch.distributed.run --nproc-per-node 4 -m vescale.cli.train_worker '{"steps": 20}'
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vescale.cli.data import BYTE_VOCABULARY, ByteTextDataset, read_text
from vescale.cli.errors import USER_ERROR_EXIT_CODE, CLIUsageError, format_user_error, user_errors
from vescale.cli.models import resolve_model
from vescale.cli.progress import TrainingProgress
from vescale.cli.recipe import default_constraints, make_lr_scheduler, make_optimizer
from vescale.cli.run_layout import RunLayout
from vescale.cli.train_options import TrainOptions

__all__ = ["main", "train"]


def _init_process_group() -> tuple[torch.device, str]:
    """Join the launcher's process group: NCCL on this rank's GPU when there is one, else gloo on CPU.

    Returns the device the batches go to and a description for the header line.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        return device, f"nccl on {torch.cuda.get_device_name()}"
    dist.init_process_group("gloo")
    return torch.device("cpu"), f"gloo on CPU, {torch.get_num_threads()} thread(s) per rank"


def _loss_value(loss: torch.Tensor) -> float:
    # The loss is the whole global batch's on every rank; a DTensor loss is read as its full value.
    full_tensor = getattr(loss, "full_tensor", None)
    return float((full_tensor() if full_tensor else loss).detach())


def _read_history(options: TrainOptions) -> dict[str, Any]:
    if options.resume and options.losses_file.is_file():
        return json.loads(options.losses_file.read_text())
    return {"steps": [], "losses": [], "tokens_per_second": []}


def _print_header(model_name: str, parameters: int, backend: str, plan: Any) -> None:
    world_size = dist.get_world_size()
    print(
        f"vescale train: {model_name} ({parameters / 1e6:.2f}M parameters) on {world_size} ranks, {backend}"
    )
    print(plan, flush=True)
    if plan.data_parallel.deterministic:
        print("data-parallel gradients summed in rank order (deterministic)", flush=True)


def train(options: TrainOptions) -> None:
    """Run the training loop of ``options`` on this rank (the process group is set up here).

    Example::

        train(TrainOptions(steps=20, checkpoint_dir="ckpt/tiny"))   # under torch.distributed.run
    """
    import vescale

    device, backend = _init_process_group()
    is_rank0 = dist.get_rank() == 0
    source = resolve_model(options.model)
    if source.vocab_size is not None and source.vocab_size < BYTE_VOCABULARY:
        raise CLIUsageError(
            f"--model {options.model!r} has vocab_size={source.vocab_size}, but the text is byte-level "
            f"({BYTE_VOCABULARY} tokens); use a config with vocab_size >= {BYTE_VOCABULARY}"
        )
    vescale.manual_seed(options.seed)
    model = vescale.deferred_init(source.build)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    plan = vescale.generate_plan(model, default_constraints(options.constraints, dist.get_world_size()))
    if options.deterministic:
        plan = dataclasses.replace(
            plan, data_parallel=dataclasses.replace(plan.data_parallel, deterministic=True)
        )
    if is_rank0:
        _print_header(source.name, parameters, backend, plan)
    dataset = ByteTextDataset(read_text(options.data), plan.sequence_length, options.seed)
    model, optimizer, scheduler, loader = vescale.parallelize(
        plan,
        model,
        lambda module: make_optimizer(module, options.learning_rate),
        make_lr_scheduler,
        dataset,
        compile=options.compile,
    )
    state = {
        "plan": plan,
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": scheduler,
        "data_loader": loader,
    }
    checkpoint_dir = Path(options.checkpoint_dir)
    history = _read_history(options)
    if options.resume:
        vescale.load(checkpoint_dir, state)
    first_step = scheduler.last_epoch
    if is_rank0 and options.resume:
        last = f", last loss {history['losses'][-1]:.4f}" if history["losses"] else ""
        print(f"resumed from {checkpoint_dir} at step {first_step}{last}", flush=True)
    tokens_per_step = plan.global_batch_size * plan.sequence_length
    batches = iter(loader)
    with TrainingProgress(options.steps, first_step, tokens_per_step, enabled=is_rank0) as progress:
        for step in range(first_step, first_step + options.steps):
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:  # the next epoch
                batches = iter(loader)
                batch = next(batches)
            loss = model(**{name: tensor.to(device) for name, tensor in batch.items()}).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            loss_value = _loss_value(loss)
            progress.update(step, loss_value, time.perf_counter() - started)
            history["steps"].append(step + 1)
            history["losses"].append(loss_value)
    saved_at = checkpoint_dir / f"step-{first_step + options.steps:06d}"
    vescale.save(saved_at, state)
    if is_rank0:
        history["tokens_per_second"].append(progress.tokens_per_second)
        history["layout"] = RunLayout.of_plan(plan, torch.get_num_threads(), device.type).to_dict()
        options.losses_file.write_text(json.dumps(history))
        if source.config is not None:
            source.config.to_json_file(str(checkpoint_dir / "config.json"))
        print(
            f"done: {options.steps} steps, loss {history['losses'][-1]:.4f}, "
            f"{progress.tokens_per_second:,.0f} tokens/s; checkpoint saved to {saved_at}",
            flush=True,
        )
    dist.destroy_process_group()


def _report_user_error(options: TrainOptions, error: BaseException) -> None:
    # The first rank to fail writes the line; the others find the file taken and stay silent.
    if options.error_file is None:
        print(format_user_error(error), file=sys.stderr)
        return
    try:
        with open(options.error_file, "x") as error_file:
            error_file.write(format_user_error(error))
    except FileExistsError:
        pass


def main(argv: list[str] | None = None) -> None:
    """The rank's entry point: ``python -m vescale.cli.train_worker '<TrainOptions JSON>'``."""
    arguments = sys.argv[1:] if argv is None else argv
    options = TrainOptions.from_json(arguments[0])
    try:
        train(options)
    except Exception as error:
        if not isinstance(error, user_errors()):
            raise
        _report_user_error(options, error)
        sys.exit(USER_ERROR_EXIT_CODE)


if __name__ == "__main__":
    main()
