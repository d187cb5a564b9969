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
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vescale.cli.data import BYTE_VOCABULARY, TokenDataset, split_for_eval, training_tokens
from vescale.cli.errors import USER_ERROR_EXIT_CODE, CLIUsageError, format_user_error, user_errors
from vescale.cli.evaluation import Evaluator
from vescale.cli.hardware_peak import rank_peak_flops
from vescale.cli.metrics import MetricsLog, flops_per_token, max_memory_bytes
from vescale.cli.models import resolve_model
from vescale.cli.pretrained import pretrained_weights, with_pretrained_weights
from vescale.cli.progress import TrainingProgress
from vescale.cli.recipe import default_constraints, make_lr_scheduler, make_optimizer, split_deterministic
from vescale.cli.run_checkpoints import (
    PeriodicCheckpoints,
    newest_checkpoint,
    step_directory,
    write_json_atomically,
)
from vescale.cli.run_layout import RunLayout
from vescale.cli.text_corpus import tokenizer_file, tokenizer_vocabulary
from vescale.cli.train_options import TrainOptions
from vescale.cli.watchdog import StepWatchdog, register_stack_dump
from vescale.doptim import clip_grad_norm_

__all__ = ["main", "train"]


def _attempt_store(attempt: int) -> dist.Store:
    """The launcher's TCP store, under a prefix of its own for this attempt.

    torchrun's agent keeps one store for the whole job (static rendezvous, and c10d's shared store),
    and its workers join it without a per-attempt prefix: a restarted rank would read the process
    group addresses the previous attempt's ranks left there and fail to connect to them.
    """
    rank = int(os.environ["RANK"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_hosts_store and rank == 0,
        timeout=datetime.timedelta(minutes=30),
    )
    return dist.PrefixStore(f"vescale.train/attempt-{attempt}", store)


def _init_process_group(attempt: int) -> tuple[torch.device, str]:
    """Join the launcher's process group: NCCL on this rank's GPU when there is one, else gloo on CPU.

    Returns the device the batches go to and a description for the header line.
    """
    store, rank, world_size = _attempt_store(attempt), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size)
        return device, f"nccl on {torch.cuda.get_device_name()}"
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return torch.device("cpu"), f"gloo on CPU, {torch.get_num_threads()} thread(s) per rank"


def _loss_value(loss: torch.Tensor) -> float:
    # The loss is the whole global batch's on every rank; a DTensor loss is read as its full value.
    full_tensor = getattr(loss, "full_tensor", None)
    return float((full_tensor() if full_tensor else loss).detach())


def _read_history(options: TrainOptions, resumed_step: int) -> dict[str, Any]:
    """The loss curve up to ``resumed_step`` (a killed attempt may have recorded steps past it)."""
    history: dict[str, Any] = {"steps": [], "losses": [], "tokens_per_second": []}
    if resumed_step > 0 and options.losses_file.is_file():
        history = json.loads(options.losses_file.read_text())
        kept = sum(1 for step in history["steps"] if step <= resumed_step)
        history["steps"], history["losses"] = history["steps"][:kept], history["losses"][:kept]
    return history


def _print_header(model_name: str, parameters: int, backend: str, plan: Any, weights: Path | None) -> None:
    world_size = dist.get_world_size()
    print(
        f"vescale train: {model_name} ({parameters / 1e6:.2f}M parameters) on {world_size} ranks, {backend}"
    )
    if weights is not None:
        print(f"weights: {weights} (each rank reads its shards)")
    print(plan, flush=True)
    if plan.data_parallel.deterministic:
        print("data-parallel gradients summed in rank order (deterministic)", flush=True)


def _vocabulary_check(options: TrainOptions, vocab_size: int | None, tokenizer: str | None) -> None:
    if vocab_size is None:
        return
    if tokenizer is None:
        needed, what = BYTE_VOCABULARY, f"byte-level ({BYTE_VOCABULARY} tokens)"
    else:
        needed, what = tokenizer_vocabulary(tokenizer), f"tokenized by {tokenizer}"
        needed_tokens = f"{needed} tokens"
        what = f"{what} ({needed_tokens})"
    if vocab_size < needed:
        raise CLIUsageError(
            f"--model {options.model!r} has vocab_size={vocab_size}, but the text is {what}; "
            f"use a config with vocab_size >= {needed}"
        )


def _eos_token_id(config: Any) -> int | None:
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def _plan(model: Any, options: TrainOptions) -> Any:
    import vescale

    constraints, deterministic = split_deterministic(options.constraints)
    plan = vescale.generate_plan(model, default_constraints(constraints, dist.get_world_size()))
    if options.deterministic or deterministic:
        plan = dataclasses.replace(
            plan, data_parallel=dataclasses.replace(plan.data_parallel, deterministic=True)
        )
    return plan


def _metrics_entry(
    step: int, loss: float, lr: float, grad_norm: float, progress: TrainingProgress, device: torch.device
) -> dict[str, Any]:
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": progress.recent_tokens_per_second,
        "mfu": progress.mfu,
        "max_memory_bytes": max_memory_bytes(device),
    }


def train(options: TrainOptions) -> None:
    """Run the training loop of ``options`` on this rank (the process group is set up here).

    Resumes from the newest complete checkpoint with ``--resume`` and in every restarted attempt
    (torchrun's ``TORCHELASTIC_RESTART_COUNT``), and trains until ``options.end_step``.

    Example::

        train(TrainOptions(steps=20, checkpoint_dir="ckpt/tiny"))   # under torch.distributed.run
    """
    import vescale
    from vescale.dcheckpoint import RNGState

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1
    device, backend = _init_process_group(attempt)
    rank = dist.get_rank()
    is_rank0 = rank == 0
    source = resolve_model(options.model)
    weights = pretrained_weights(options.model)
    tokenizer = tokenizer_file(options.tokenizer, options.model)
    _vocabulary_check(options, source.vocab_size, tokenizer)
    vescale.manual_seed(options.seed)
    model = vescale.deferred_init(source.build)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    plan = _plan(model, options)
    flops_per_step = (
        flops_per_token(model, plan.sequence_length) * plan.global_batch_size * plan.sequence_length
    )
    if is_rank0:
        _print_header(source.name, parameters, backend, plan, weights)
    tokens = training_tokens(options.data, tokenizer, options.text_field, _eos_token_id(source.config))
    dataset = TokenDataset(tokens, plan.sequence_length, options.seed)
    held_out = None
    if options.eval_every > 0:
        dataset, held_out = split_for_eval(dataset, options.eval_fraction)
    model, optimizer, scheduler, loader = vescale.parallelize(
        plan,
        model,
        with_pretrained_weights(lambda module: make_optimizer(module, options.learning_rate), weights),
        make_lr_scheduler,
        dataset,
        compile=options.compile,
    )
    if optimizer is None:  # parallelize returns one whenever it is given an optimizer factory
        raise AssertionError("vescale.parallelize returned no optimizer")
    evaluator = Evaluator(held_out, loader, plan, device) if held_out is not None else None
    state = {
        "plan": plan,
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": scheduler,
        "data_loader": loader,
        "rng": RNGState(),
    }
    checkpoint_dir = Path(options.checkpoint_dir)
    found = newest_checkpoint(checkpoint_dir) if options.resume or attempt > 1 else None
    if found is not None:
        vescale.load(found[1], state)
    first_step = scheduler.last_epoch
    history = _read_history(options, first_step) if is_rank0 else {}
    if is_rank0 and found is not None:
        last = f", last loss {history['losses'][-1]:.4f}" if history["losses"] else ""
        where = f"attempt {attempt}: " if attempt > 1 else ""
        print(f"{where}resumed from {checkpoint_dir} at step {first_step}{last}", flush=True)
    elif is_rank0 and attempt > 1:
        print(f"attempt {attempt}: no checkpoint was complete yet; starting again at step 0", flush=True)
    dtype = next(model.parameters()).dtype
    peak = rank_peak_flops(device, options.cpu_peak_flops, dtype) if is_rank0 else None
    saver = PeriodicCheckpoints(checkpoint_dir, options.save_every, options.keep_last, options.end_step)
    batches = iter(loader)
    with (
        StepWatchdog(options.timeout_s, rank, options.stall_file) as watchdog,
        MetricsLog(options.metrics_file, options.tensorboard, first_step, enabled=is_rank0) as metrics,
        TrainingProgress(
            options.end_step - first_step,
            first_step,
            plan.global_batch_size * plan.sequence_length,
            enabled=is_rank0,
            log_every=options.log_every,
            flops_per_step=flops_per_step,
            peak_flops=peak * dist.get_world_size() if peak else None,
        ) as progress,
    ):
        for step in range(first_step, options.end_step):
            watchdog.arm(step + 1)
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:  # the next epoch
                batches = iter(loader)
                batch = next(batches)
            loss = model(**{name: tensor.to(device) for name, tensor in batch.items()}).loss
            loss.backward()
            logs = progress.logs(step)
            # Scaling by min(1, inf / norm) = 1 leaves the gradients bit for bit; only the norm is wanted.
            grad_norm = float(clip_grad_norm_(optimizer, math.inf)) if logs else math.nan
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            loss_value = _loss_value(loss)
            progress.update(step, loss_value, time.perf_counter() - started)
            if is_rank0:
                history["steps"].append(step + 1)
                history["losses"].append(loss_value)
            if logs:
                metrics.write(_metrics_entry(step + 1, loss_value, lr, grad_norm, progress, device))
            if evaluator is not None and (
                (step + 1) % options.eval_every == 0 or step + 1 == options.end_step
            ):
                eval_loss = evaluator.loss(model)
                metrics.write(
                    {"step": step + 1, "eval_loss": eval_loss, "eval_perplexity": math.exp(eval_loss)}
                )
                if is_rank0:
                    progress.console.print(
                        f"step {step + 1:>6}  eval loss {eval_loss:.4f}  "
                        f"perplexity {math.exp(eval_loss):.2f}",
                        highlight=False,
                    )
            if saver.due(step + 1):
                if is_rank0:  # before the save: a checkpoint never lacks its steps' losses
                    write_json_atomically(options.losses_file, history)
                saver.save(step + 1, state)
        watchdog.disarm()
    saver.finish()
    if is_rank0:
        history["tokens_per_second"].append(progress.tokens_per_second)
        history["layout"] = RunLayout.of_plan(plan, torch.get_num_threads(), device.type).to_dict()
        write_json_atomically(options.losses_file, history)
        if source.config is not None:
            source.config.to_json_file(str(checkpoint_dir / "config.json"))
        last = f"loss {history['losses'][-1]:.4f}, " if history["losses"] else ""
        print(
            f"done: {options.end_step - first_step} steps, {last}"
            f"{progress.tokens_per_second:,.0f} tokens/s; checkpoint saved to "
            f"{step_directory(checkpoint_dir, options.end_step)}",
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
    register_stack_dump()  # the launcher asks a stopped or stuck rank for its stack
    try:
        train(options)
    except Exception as error:
        if not isinstance(error, user_errors()):
            raise
        _report_user_error(options, error)
        sys.exit(USER_ERROR_EXIT_CODE)


if __name__ == "__main__":
    main()
