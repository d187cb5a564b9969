"""``--compare-single-device``: the same training in one process, in plain PyTorch, beside veScale's.

The reference builds the model eagerly after ``torch.manual_seed(seed)`` (what
``vescale.manual_seed`` + ``vescale.deferred_init`` reproduce), uses the same optimizer and
schedule (:mod:`vescale.cli.recipe`) and reads the same global batches: the dataset in order,
which ``vescale.DistributedDataLoader`` cuts into one contiguous slice per data-parallel rank.

It repeats the parallel run's arithmetic, not only its mathematics (see :class:`RunLayout`):
each rank's slice runs as that rank's micro-batches, backward on the loss weighted as
``vescale.parallelize`` weights it (``loss * (1 / pieces) * dp``), gradients accumulating
within the slice; the slices' gradients are then summed in rank order and divided by dp, as
doptim's deterministic reduction does, on as many threads as a rank had. With
``plan.data_parallel.deterministic`` and no tensor or pipeline split the loss curves are
then equal bit for bit.

Example::

    losses = reference_losses(options, RunLayout(global_batch_size=32, sequence_length=128))
"""

from __future__ import annotations

from typing import Any

import torch
from rich.progress import track
from torch import nn
from torch.utils.data import DataLoader

from vescale.cli.data import TokenDataset, split_for_eval, training_tokens
from vescale.cli.models import resolve_model
from vescale.cli.pretrained import pretrained_weights
from vescale.cli.recipe import make_lr_scheduler, make_optimizer
from vescale.cli.run_layout import RunLayout
from vescale.cli.text_corpus import tokenizer_file
from vescale.cli.train_options import TrainOptions

__all__ = ["reference_losses"]


def _rows(batch: dict[str, torch.Tensor], pieces: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into ``pieces`` contiguous equal slices of rows, as dp ranks and micro-batches cut it."""
    size = next(iter(batch.values())).shape[0] // pieces
    return [
        {name: rows[index * size : (index + 1) * size] for name, rows in batch.items()}
        for index in range(pieces)
    ]


def _reference_step(
    model: nn.Module, parameters: list[nn.Parameter], batch: dict[str, Any], layout: RunLayout
) -> float:
    """Forward and backward of one global batch as the parallel ranks ran it; leaves the averaged grads.

    Returns the global batch's loss as the ranks report it: the float32 weighted losses of each
    rank's micro-batches added in order, then summed over the ranks in float64.
    """
    dp = layout.data_parallel
    # A piece's share of the loss terms: equal pieces of an unpadded batch, so terms / total = 1 / pieces
    # exactly as parallelize computes it (both quotients are correctly rounded from the same value).
    share = 1.0 / (dp * layout.micro_batches_per_rank)
    rank_losses: list[torch.Tensor] = []
    # (((g_0 + g_1) + g_2) + ...) / dp: doptim's deterministic, rank-ordered average, summed as each
    # rank's gradients are ready (two copies of the gradients at a time, not dp).
    gradient_sums: list[torch.Tensor] = []
    for rank_batch in _rows(batch, dp):
        model.zero_grad(set_to_none=True)  # the sums keep the earlier ranks' gradient tensors
        rank_loss = None
        for micro_batch in _rows(rank_batch, layout.micro_batches_per_rank):
            weighted = model(**micro_batch).loss * share
            (weighted * dp).backward()
            weighted = weighted.detach()
            rank_loss = weighted if rank_loss is None else rank_loss + weighted
        if rank_loss is None:
            raise AssertionError("a rank's rows made no micro-batch")
        rank_losses.append(rank_loss)
        # A parameter this rank's rows did not reach (an idle expert) adds zeros, as in a reduction.
        gradients = [
            torch.zeros_like(weight) if weight.grad is None else weight.grad for weight in parameters
        ]
        if not gradient_sums:
            gradient_sums = gradients
        else:
            for gradient_sum, gradient in zip(gradient_sums, gradients, strict=True):
                gradient_sum.add_(gradient)
    for gradient_sum, parameter in zip(gradient_sums, parameters, strict=True):
        parameter.grad = gradient_sum.div_(dp)
    return float(torch.stack(rank_losses).to(torch.float64).sum().to(torch.float32))


def reference_losses(options: TrainOptions, layout: RunLayout) -> list[float]:
    """The loss of each of ``options.steps`` steps of single-process float32 training.

    Example::

        losses = reference_losses(TrainOptions(steps=5), RunLayout(global_batch_size=32, sequence_length=128))
    """
    torch.set_num_threads(layout.threads_per_rank)
    torch.manual_seed(options.seed)
    source = resolve_model(options.model)
    model = source.build()
    weights = pretrained_weights(options.model)
    if weights is not None:
        from vescale.dcheckpoint import load_hf

        load_hf(model, weights)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = make_optimizer(model, options.learning_rate)
    scheduler = make_lr_scheduler(optimizer)
    eos = getattr(source.config, "eos_token_id", None)
    tokens = training_tokens(
        options.data,
        tokenizer_file(options.tokenizer, options.model),
        options.text_field,
        eos if isinstance(eos, int) else None,
    )
    dataset = TokenDataset(tokens, layout.sequence_length, options.seed)
    if options.eval_every > 0:
        dataset, _ = split_for_eval(dataset, options.eval_fraction)
    loader = DataLoader(dataset, batch_size=layout.global_batch_size, shuffle=False, drop_last=True)
    losses: list[float] = []
    batches = iter(loader)
    # A transient bar: the reference can take as long as the parallel run; a pipe sees nothing of it.
    for _ in track(range(options.steps), description="single device", transient=True):
        try:
            batch = next(batches)
        except StopIteration:  # the next epoch, in the same order (the parallel loader does not shuffle)
            batches = iter(loader)
            batch = next(batches)
        losses.append(_reference_step(model, parameters, batch, layout))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses
