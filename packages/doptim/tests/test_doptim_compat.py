"""Fails loudly when PyTorch renames or removes a private API that vescale.doptim relies on."""

from __future__ import annotations

import torch

from vescale.doptim import _compat


def test_installed_torch_is_within_the_supported_range():
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert (major, minor) >= _compat.MIN_TORCH, torch.__version__


def test_end_of_backward_callback_runs_once_after_the_last_gradient():
    events: list[str] = []
    weight = torch.ones(2, requires_grad=True)

    def on_gradient(_: torch.Tensor) -> None:
        events.append("grad")
        _compat.queue_end_of_backward_callback(lambda: events.append("end"))

    weight.register_post_accumulate_grad_hook(on_gradient)
    (weight * 3).sum().backward()
    assert events == ["grad", "end"]
