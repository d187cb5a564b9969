"""The tiny MLP of the data-parallel tests: two tanh blocks in a ``ModuleList`` and a linear head.

Two blocks make two ZeRO-3 (FSDP2) units besides the root; widths 8 -> 16 -> 12 -> ``outputs``
make parameters of several sizes, so small buckets and ZeRO chunks cut through some of them.
:func:`mlp_batches` are its regression batches (``(inputs, targets)`` pairs, mean-squared error).

Example::

    model = build_tiny_mlp()
    inputs, targets = mlp_batches(steps=1, rows=4)[0]
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyMLP", "build_tiny_mlp", "mlp_batches", "mse_loss"]


class TinyMLP(nn.Module):
    """Linear(8, 16) + tanh, Linear(16, 12) + tanh (``blocks``), then ``head`` = Linear(12, outputs)."""

    def __init__(self, outputs: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 12), nn.Tanh())]
        )
        self.head = nn.Linear(12, outputs)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = block(inputs)
        output: torch.Tensor = self.head(inputs)
        return output


def build_tiny_mlp(seed: int = 0, outputs: int = 4) -> TinyMLP:
    """A :class:`TinyMLP` initialised after ``torch.manual_seed(seed)``.

    Example::

        assert torch.equal(build_tiny_mlp().head.weight, build_tiny_mlp().head.weight)
    """
    torch.manual_seed(seed)
    return TinyMLP(outputs)


def mlp_batches(
    steps: int,
    rows: int,
    *,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
    outputs: int = 4,
    inputs: int = 8,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``rows`` random inputs (width ``inputs``) and targets (width ``outputs``).

    Example::

        inputs, targets = mlp_batches(steps=10, rows=8)[0]
    """
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(rows, inputs, generator=generator).to(dtype),
            torch.randn(rows, outputs, generator=generator).to(dtype),
        )
        for _ in range(steps)
    ]


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of an ``(inputs, targets)`` batch: mean-squared error (a ``train_reference`` ``loss_fn``).

    Example::

        loss = mse_loss(build_tiny_mlp(), mlp_batches(1, 4)[0])
    """
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)
