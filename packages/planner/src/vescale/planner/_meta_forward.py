"""Running a model's forward on meta tensors, mixture-of-experts layers included.

The planner learns a model's structure (its tensor-parallel dataflow) and activation sizes
from one forward on meta tensors. Two things stand in the way for ``transformers``'
mixture-of-experts models:

* a model from ``vescale.deferred_init`` holds fake tensors, on which data-dependent ops fail
  and meta-only shortcuts (dmodule's trace answers data-dependent ops on meta) do not apply:
  :func:`meta_parameters` swaps every parameter and buffer for a meta tensor of its shape
  while the analysis runs, and puts the originals back;
* ``aten._grouped_mm``'s meta kernel accepts bfloat16 only (torch 2.13), while the experts
  run in the model's float32: ``vescale.dtensor.grouped_mm_shapes.GroupedMatmulShapes``
  (shared with dpipe's split) answers it with the output's shape.

Model code also reads values during its forward (``transformers``' packed-sequence detection
asks ``(position_ids[:, -1] == 0).all()`` once ``use_cache=False``), which meta tensors cannot
answer: ``vescale.dtensor.deferred.fake_values.FakeValuePolicy`` (shared with dmodule's trace
and dpipe's split) answers such reads with the values of an ordinary training batch.

Example::

    with meta_parameters(model), GroupedMatmulShapes():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["meta_parameters"]


@contextlib.contextmanager
def meta_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every parameter and buffer replaced by a meta tensor of its shape, inside.

    Parameters stay ``nn.Parameter`` (with their ``requires_grad``) and shared ones stay shared,
    so FQN-based analyses see the model as it is; the originals are restored on exit.

    Example::

        with meta_parameters(model):
            result = plan_tensor_parallel(model)
    """
    originals: list[tuple[nn.Module, str, Any]] = []
    replacements: dict[int, Any] = {}

    def meta_of(tensor: torch.Tensor, is_parameter: bool) -> Any:
        if id(tensor) not in replacements:
            meta = torch.empty_like(tensor, device="meta")
            replacements[id(tensor)] = (
                nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_parameter else meta
            )
        return replacements[id(tensor)]

    try:
        for module in model.modules():
            # Assigning to a registered name replaces that parameter or buffer (nn.Module.__setattr__).
            own: list[tuple[str, bool, torch.Tensor]] = [
                (name, True, p) for name, p in module.named_parameters(recurse=False)
            ]
            own += [(name, False, b) for name, b in module.named_buffers(recurse=False)]
            for name, is_parameter, tensor in own:
                originals.append((module, name, tensor))
                setattr(module, name, meta_of(tensor, is_parameter))
        yield model
    finally:
        for module, name, tensor in reversed(originals):
            setattr(module, name, tensor)
