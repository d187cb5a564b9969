"""The private PyTorch APIs that ``vescale.dpipe`` relies on, confined to this module.

Automatic splitting runs the model once on fake tensors (shapes without storage) to learn
the order in which modules run and their FLOPs. ``transformers`` recognises fake tensors and
skips its data-dependent checks for them, which plain ``meta`` tensors do not get. Fake
tensors live in the private ``torch._subclasses``; ``tests/test_dpipe_compat.py`` fails
loudly when a PyTorch release renames or removes it.

Example::

    from vescale.dpipe import _compat
    with _compat.fake_tensor_mode():
        ids = torch.zeros(1, 16, dtype=torch.long)   # a fake tensor, no storage
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["MIN_TORCH", "TESTED_TORCH", "PrivateTorchAPIError", "fake_tensor_mode"]

MIN_TORCH = (2, 11)
# The newest release these private attributes were checked against.
TESTED_TORCH = (2, 13)


class PrivateTorchAPIError(RuntimeError):
    """A private PyTorch attribute that vescale.dpipe relies on is missing or changed."""


def _missing(what: str) -> PrivateTorchAPIError:
    return PrivateTorchAPIError(
        f"{what} is missing in torch {torch.__version__}; vescale.dpipe was checked against torch "
        f"{MIN_TORCH[0]}.{MIN_TORCH[1]} to {TESTED_TORCH[0]}.{TESTED_TORCH[1]}. Install a torch in "
        "that range, or update vescale/dpipe/_compat.py for this release."
    )


def fake_tensor_mode() -> AbstractContextManager[Any]:
    """A ``FakeTensorMode`` that also accepts real tensors (the model's parameters) as inputs."""
    try:
        fake_tensor_module = importlib.import_module("torch._subclasses.fake_tensor")
    except ImportError as error:
        raise _missing("torch._subclasses.fake_tensor") from error
    mode_class = getattr(fake_tensor_module, "FakeTensorMode", None)
    if mode_class is None:
        raise _missing("torch._subclasses.fake_tensor.FakeTensorMode")
    try:
        mode: AbstractContextManager[Any] = mode_class(allow_non_fake_inputs=True)
        return mode
    except TypeError as error:
        raise _missing("FakeTensorMode(allow_non_fake_inputs=...)") from error
