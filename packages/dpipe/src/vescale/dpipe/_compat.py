"""The private PyTorch APIs that ``vescale.dpipe`` relies on, confined to this module.

Automatic splitting runs the model once on fake tensors (shapes without storage) to learn
the order in which modules run and their FLOPs. ``transformers`` recognises fake tensors and
skips its data-dependent checks for them, which plain ``meta`` tensors do not get. Fake
tensors live in the private ``torch._subclasses``; ``tests/test_dpipe_compat.py`` fails
loudly when a PyTorch release renames or removes it.

A tensor-parallel model's fake pass also runs DTensor's own bookkeeping (a ``_StridedShard``'s
offsets, the strategy of an op found through its decomposition), which builds tensors that the
fake mode must not capture: :func:`dtensor_bookkeeping_outside_fake_mode` runs it outside.

PyTorch's ``PipelineStage`` learns a later stage's input shapes on its first step by running
the stage on tensors made from metadata, uninitialised: :func:`pipeline_stage_class` fills them
with zeros, so the ranks of a tensor-parallel stage take the same data-dependent branches there.

Example::

    from vescale.dpipe import _compat
    with _compat.fake_tensor_mode():
        ids = torch.zeros(1, 16, dtype=torch.long)   # a fake tensor, no storage
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

# One supported torch range and one error type for every package's _compat.py: vescale.dtensor's.
from vescale.dtensor._compat import (
    MIN_TORCH,
    TESTED_TORCH,
    PrivateTorchAPIError,
    torch_version,
    unsupported_torch,
)

__all__ = [
    "MIN_TORCH",
    "TESTED_TORCH",
    "PrivateTorchAPIError",
    "dtensor_bookkeeping_outside_fake_mode",
    "fake_tensor_mode",
    "pipeline_stage_class",
]


def _missing(what: str) -> PrivateTorchAPIError:
    return unsupported_torch(f"{what} is missing", "vescale.dpipe")


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


# DTensor's own bookkeeping that builds tensors and must not see the fake mode of the pass:
# (module, class, method, whether only plain integer sizes (not a compiled graph's symbols) qualify).
_BOOKKEEPING_METHODS = (
    # A _StridedShard's shard sizes and offsets: torch.arange(size) read back with tolist().
    ("torch.distributed.tensor.placement_types", "_StridedShard", "local_shard_size_and_offset", True),
    # The sharding strategy of an op without one, found by running its decomposition on meta tensors.
    ("torch.distributed.tensor._decompositions", "DecompShardingStrategy", "propagate_strategy", False),
)


_bookkeeping_lock = threading.Lock()
# (owner class, method name, PyTorch's method) of the installed wrappers, and the passes inside.
_bookkeeping_originals: list[tuple[type, str, Any]] = []
_bookkeeping_users = [0]


def _bookkeeping_method(module_name: str, class_name: str, method: str) -> tuple[type, Any]:
    what = f"{module_name}.{class_name}.{method}"
    try:
        owner = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError as error:
        raise _missing(what) from error
    if not isinstance(owner, type) or not callable(owner.__dict__.get(method)):
        raise _missing(what)
    return owner, owner.__dict__[method]


def _unset_fake_temporarily() -> Any:
    fake_tensor_module = importlib.import_module("torch._subclasses.fake_tensor")
    unset = getattr(fake_tensor_module, "unset_fake_temporarily", None)
    if unset is None:
        raise _missing("torch._subclasses.fake_tensor.unset_fake_temporarily")
    return unset


def _outside_fake_mode(original: Any, integer_sizes_only: bool, unset_fake: Any) -> Any:
    def method(self: Any, first: Any, *args: Any, **kwargs: Any) -> Any:
        if integer_sizes_only and not isinstance(first, int):
            return original(self, first, *args, **kwargs)
        with unset_fake():
            return original(self, first, *args, **kwargs)

    return method


@contextlib.contextmanager
def dtensor_bookkeeping_outside_fake_mode() -> Iterator[None]:
    """Inside, DTensor's own index and strategy computations run outside the active ``FakeTensorMode``.

    A tensor-parallel model's fake pass dispatches DTensor ops, and two pieces of DTensor's
    bookkeeping build tensors of their own that the fake mode captures:

    - a ``_StridedShard`` (a fused QKV or gate/up weight) derives its shard offsets from
      ``torch.arange(size).tolist()``; a fake index tensor cannot be read
      (``DataDependentOutputException``);
    - an op without a registered strategy (``log_sigmoid_forward``, Inkling's router) gets one
      by running its decomposition on meta tensors of a size-1 mesh; under the fake mode every
      candidate fails and the op "has no sharding strategy".

    Both depend only on sizes and placements, so running them outside the fake mode is exact;
    ``_StridedShard`` offsets of symbolic sizes (a compiled graph) keep PyTorch's own path.

    Example::

        with _compat.fake_tensor_mode(), _compat.dtensor_bookkeeping_outside_fake_mode():
            output = tensor_parallel_model(**fake_batch)
    """
    unset_fake = _unset_fake_temporarily()
    with _bookkeeping_lock:
        # The methods are class attributes, shared by every thread: the first pass in installs
        # the wrappers, the last one out restores PyTorch's methods (also when passes overlap).
        if not _bookkeeping_originals:
            for module_name, class_name, method, integer_sizes_only in _BOOKKEEPING_METHODS:
                owner, original = _bookkeeping_method(module_name, class_name, method)
                _bookkeeping_originals.append((owner, method, original))
                setattr(owner, method, _outside_fake_mode(original, integer_sizes_only, unset_fake))
        _bookkeeping_users[0] += 1
    try:
        yield
    finally:
        with _bookkeeping_lock:
            _bookkeeping_users[0] -= 1
            if not _bookkeeping_users[0]:
                for owner, method, original in _bookkeeping_originals:
                    setattr(owner, method, original)
                _bookkeeping_originals.clear()


@functools.cache
def pipeline_stage_class() -> type:
    """``PipelineStage``, with two repairs of PyTorch's own.

    * **Metadata inference on zeros.** From torch 2.13 a stage after the first runs its forward
      (and backward) once on tensors built from the received metadata with ``torch.empty``
      (``_PipelineStageBase._to_tensor``) to learn its output shapes. Each rank's garbage
      differs; where the stage routes tokens by value (a mixture-of-experts layer's per-expert
      counts, read with ``tolist()``) the ranks of a tensor-parallel stage then split
      differently and enter their collectives with different sizes: gloo hangs or aborts
      (JetMoE under pp2 x tp2). Zeros are the same on every rank. Earlier releases infer
      shapes on meta tensors and have no ``_to_tensor``.
    * **Forward-only calls of a V-schedule.** ``schedule.eval()`` runs the schedule's actions
      with ``has_backward`` off, the backward ones included (each returns at once), but where
      two adjacent stages share a rank (ZBV) it still hands the later stage's input gradient
      to the earlier one (``get_local_bwd_output``), which asserts that the stage has a
      backward: every ``torch.no_grad()`` call of a ZBV pipeline failed. Without a backward
      there is no gradient to hand over.

    Example::

        stage = _compat.pipeline_stage_class()(module, stage_index, num_stages, device, group=pp_group)
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor

    original = getattr(PipelineStage, "_to_tensor", None)
    if original is None and torch_version() >= (2, 13):
        raise _missing("torch.distributed.pipelining.PipelineStage._to_tensor")
    to_tensor: Any = original  # a closure mypy does not narrow

    class RepairedPipelineStage(PipelineStage):
        def _to_tensor(self, arg: Any) -> torch.Tensor:
            tensor: torch.Tensor = to_tensor(self, arg)
            if not isinstance(arg, torch.Tensor):  # metadata, made into an uninitialised tensor
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                with torch.no_grad():
                    local.zero_()
            return tensor

        def get_local_bwd_output(self, mb_index: int) -> Any:
            if not self.has_backward:  # a forward-only call: no backward ran, no gradient to pass
                return ()
            return super().get_local_bwd_output(mb_index)  # type: ignore[no-untyped-call]

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if not self.has_backward:
                return
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    if original is None:  # before torch 2.13: shapes are inferred on meta tensors
        del RepairedPipelineStage._to_tensor
    for method in ("get_local_bwd_output", "set_local_bwd_input"):
        if not callable(getattr(PipelineStage, method, None)):  # no V-schedule hand-over to repair
            delattr(RepairedPipelineStage, method)
    return RepairedPipelineStage
