"""Compile the repeated blocks of a parallelized module, as torchtitan compiles each decoder layer.

``torch.compile`` of a block's ``forward`` traces the plan's input conversions of the modules
inside it (the block's own hooks, and those of the modules around it, stay eager). Two things
keep that as cheap as torchtitan's per-layer compile:

* **One conversion per tensor.** Sibling modules that read one tensor in the placements it
  already has (the q, k and v projections reading one normalised hidden state) share one
  conversion, as in eager mode, so the backward reduces their summed gradient once instead of
  once per consumer: two all-reduces per Llama block instead of five, the count of
  torchtitan's ``PrepareModuleInput``. The shared conversions live in a dictionary made within
  each compiled call (``InputConversionCache.compiled_call``).
* **One compiled graph for all blocks.** Dynamo guards on what the traced code reads. The hooks
  that do nothing inside traced code (implicit replication's enter/exit hooks below the block,
  the failure notes of ``vescale.dmodule.debug``, whose always-called hooks are guarded by their
  ids) are taken off the block's modules, and the placement hooks name a module by its class
  there rather than its FQN: every block then passes the first block's guards.

Example::

    parallelize_module(model, mesh, plan)
    compile_blocks(model, list(model.model.layers))
    model(input_ids).logits.sum().backward()      # one graph for all layers, 2 all-reduces each
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vescale.dmodule._forward_hooks import InputConversionCache
from vescale.dmodule.debug import stop_naming_failures
from vescale.dmodule.parallelize import DMODULE_ATTRIBUTE

__all__ = ["compile_blocks"]


def compile_blocks(root: nn.Module, blocks: Iterable[nn.Module]) -> None:
    """Replace each block's ``forward`` by its ``torch.compile``d form, conversions shared per call.

    ``root`` holds the blocks and the DModules (``parallelize_module``'d modules) whose plans
    reach into them; it may itself be one. A block outside every DModule is compiled all the same.

    Example::

        compile_blocks(model, list(model.model.layers))
    """
    states = [
        state for module in root.modules() if (state := getattr(module, DMODULE_ATTRIBUTE, None)) is not None
    ]
    caches = [state.conversions for state in states]
    for block in blocks:
        stop_naming_failures(block)
        for state in states:
            state.implicit_replication.remove_inside(block)
        block.forward = torch.compile(_sharing_conversions(block.forward, caches))


def _sharing_conversions(
    forward: Callable[..., Any], caches: list[InputConversionCache]
) -> Callable[..., Any]:
    """``forward`` within each cache's ``compiled_call`` (traced by the compile around it)."""
    for cache in caches:
        forward = functools.wraps(forward)(functools.partial(cache.compiled_call, forward))
    return forward
