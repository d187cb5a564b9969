"""Activation checkpointing ``"full"``: every repeated block recomputes its forward during backward.

The repeated blocks are the elements of the model's ``nn.ModuleList``s (a transformer's
layers); each one's ``forward`` is replaced on the instance by a call through
``torch.utils.checkpoint`` (non-reentrant), so the model's class, its module tree and its
``state_dict`` keys stay as they were, and hooks that other packages put on the block
(dmodule's placements, FSDP2's unshard) run around the checkpointed call as before.

Example::

    blocks = checkpoint_repeated_blocks(model)   # ["model.layers.0", "model.layers.1", ...]
    model(**batch).loss.backward()               # each block's activations recomputed here
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from vescale.api.errors import UnsupportedPlanError

__all__ = ["checkpoint_repeated_blocks", "repeated_blocks"]


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The elements of the outermost ``nn.ModuleList``s of ``model`` (a transformer's layers), by FQN.

    Example::

        names = [fqn for fqn, _ in repeated_blocks(model)]
        assert names == [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    """
    blocks: list[tuple[str, nn.Module]] = []
    for list_fqn, module_list in model.named_modules():
        # Only the outermost lists: a list inside a block (experts of a layer) goes with its block.
        inside_block = any(list_fqn.startswith(f"{block_fqn}.") for block_fqn, _ in blocks)
        if isinstance(module_list, nn.ModuleList) and not inside_block:
            prefix = f"{list_fqn}." if list_fqn else ""
            blocks += [(f"{prefix}{index}", block) for index, block in enumerate(module_list)]
    return blocks


def checkpoint_repeated_blocks(model: nn.Module) -> list[str]:
    """Make each element of every ``nn.ModuleList`` of ``model`` recompute its forward; return their FQNs.

    Example::

        names = checkpoint_repeated_blocks(model)
        assert names == [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    """
    blocks = repeated_blocks(model)
    if not blocks:
        raise UnsupportedPlanError(
            f"activation_checkpointing='full' checkpoints each repeated block (an element of an "
            f"nn.ModuleList), but {type(model).__name__} has no nn.ModuleList; set "
            "activation_checkpointing to 'none'"
        )
    for _, block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return [name for name, _ in blocks]
