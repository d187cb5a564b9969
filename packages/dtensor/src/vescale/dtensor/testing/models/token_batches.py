"""Random token batches for the tiny causal LMs: ``{"input_ids", "labels"}`` dicts, labels the ids.

A causal LM shifts the labels itself, so the labels are a copy of the ids (every position a
target: equal token counts in every micro-batch and data-parallel slice).

Example::

    batches = token_batches(64, steps=5, batch_size=4, seq_len=8)
    loss = model(**batches[0]).loss
"""

from __future__ import annotations

import torch

__all__ = ["token_batches"]


def token_batches(
    vocab_size: int, steps: int, batch_size: int, seq_len: int, seed: int = 1
) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of ``batch_size`` x ``seq_len`` ids drawn in order from ``seed``.

    Example::

        first = token_batches(64, steps=1, batch_size=2, seq_len=8)[0]
        assert torch.equal(first["input_ids"], first["labels"])
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
        batches.append({"input_ids": input_ids, "labels": input_ids.clone()})
    return batches
