"""``--eval-every``: the loss of the held-out samples, computed as the training loss is (global batches).

The held-out split (:func:`vescale.cli.data.split_for_eval`) is read in global batches of the
plan's size; each data-parallel rank takes its contiguous slice, as ``DistributedDataLoader``
cuts training batches, so the parallelized model returns each global batch's loss. The eval
loss is the mean over the held-out batches; perplexity is its exponential.

Example::

    evaluator = Evaluator(held_out, loader, plan, torch.device("cpu"))
    eval_loss = evaluator.loss(model)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from vescale.cli.errors import CLIUsageError

__all__ = ["Evaluator"]


class Evaluator:
    """The held-out samples' loss under the parallel model, in the training loop's batch layout."""

    def __init__(
        self, held_out: Dataset[dict[str, torch.Tensor]], loader: Any, plan: Any, device: torch.device
    ) -> None:
        if plan.pipeline is not None:
            raise CLIUsageError(
                "--eval-every runs forward passes without backward, which pipeline schedules do not; "
                "drop --eval-every or the pipeline_parallel constraint"
            )
        self.global_batch_size = plan.global_batch_size
        samples = len(held_out)  # type: ignore[arg-type]  # a map-style dataset: TokenDataset
        self.batches = samples // self.global_batch_size
        if self.batches < 1:
            raise CLIUsageError(
                f"the held-out split has {samples} samples, fewer than one global batch of "
                f"{self.global_batch_size}; raise --eval-fraction or use more --data"
            )
        self.held_out = held_out
        self.local_rows = loader.local_batch_size
        self.first_row = loader.dp_rank * self.local_rows
        self.device = device

    def loss(self, model: nn.Module) -> float:
        """The mean loss of the held-out global batches (every rank calls it; each gets the same value)."""
        total = 0.0
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for batch_index in range(self.batches):
                start = batch_index * self.global_batch_size + self.first_row
                rows = default_collate([self.held_out[start + row] for row in range(self.local_rows)])
                loss = model(**{name: tensor.to(self.device) for name, tensor in rows.items()}).loss
                full_tensor = getattr(loss, "full_tensor", None)
                total += float((full_tensor() if full_tensor else loss).detach())
        model.train(was_training)
        return float(total / self.batches)
