"""Activation checkpointing of every repeated block: ``"full"`` or ``"selective"`` recomputation.

The repeated blocks are the elements of the model's ``nn.ModuleList``s (a transformer's
layers); each one's ``forward`` is replaced on the instance by a call through
``torch.utils.checkpoint`` (non-reentrant), so the model's class, its module tree and its
``state_dict`` keys stay as they were, and hooks that other packages put on the block
(dmodule's placements, FSDP2's unshard) run around the checkpointed call as before.

* ``"full"``: a block keeps only its input; backward recomputes its whole forward.
* ``"selective"``: a block also keeps the outputs of its matmuls, attention kernels and
  tensor-parallel reductions (``vescale.planner.selective``, which the planner's memory
  estimate counts too); backward recomputes only the cheap ops between them.

A ``transformers`` KV cache would be filled again by each recomputation (and keeps every
block's keys and values alive), so ``vescale.parallelize`` passes ``use_cache=False`` to the
training calls of a checkpointed model, as ``transformers``' own gradient checkpointing does.

Example::

    blocks = checkpoint_repeated_blocks(model)   # ["model.layers.0", "model.layers.1", ...]
    model(**batch).loss.backward()               # each block's activations recomputed here
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from vescale.api.errors import UnsupportedPlanError
from vescale.dtensor.batch_random import BatchPiece, batch_piece_random, current_piece
from vescale.planner.selective import selective_policy

__all__ = ["checkpoint_repeated_blocks", "repeated_blocks"]

RECOMPUTE_MODES = ("full", "selective")


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    piece = current_piece()
    if piece is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_piece_contexts(piece, None), **kwargs)


def _selective_contexts() -> Any:
    # torch leaves create_selective_checkpoint_contexts unannotated.
    return create_selective_checkpoint_contexts(selective_policy)  # type: ignore[no-untyped-call]


def _selectively_checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    piece = current_piece()
    context_fn = _selective_contexts if piece is None else _piece_contexts(piece, _selective_contexts)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _piece_contexts(piece: BatchPiece, inner: Callable[[], Any] | None) -> Callable[[], Any]:
    """A ``context_fn`` whose recomputation draws random numbers as the forward did, for ``piece`` of
    the global batch (:mod:`vescale.api._piece_random`): a backward the caller runs is outside the
    piece's replay, which the recomputation enters again (inside it, entering adds nothing)."""

    @contextlib.contextmanager
    def recompute_in_piece(inner_recompute: Any) -> Iterator[None]:
        with batch_piece_random(piece), inner_recompute:
            yield

    def contexts() -> tuple[Any, Any]:
        forward_context, recompute_context = (
            inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        )
        return forward_context, recompute_in_piece(recompute_context)

    return contexts


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


def checkpoint_repeated_blocks(model: nn.Module, mode: str = "full") -> list[str]:
    """Make each element of every ``nn.ModuleList`` of ``model`` recompute its forward; return their FQNs.

    ``mode``: ``"full"`` (recompute everything) or ``"selective"`` (keep the matmul, attention and
    reduction outputs; see the module docstring).

    Example::

        names = checkpoint_repeated_blocks(model, "selective")
        assert names == [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    """
    if mode not in RECOMPUTE_MODES:
        raise UnsupportedPlanError(
            f"activation checkpointing mode {mode!r} is not one of {RECOMPUTE_MODES} ('none' "
            "checkpoints nothing: do not call checkpoint_repeated_blocks)"
        )
    blocks = repeated_blocks(model)
    if not blocks:
        raise UnsupportedPlanError(
            f"activation_checkpointing={mode!r} checkpoints each repeated block (an element of an "
            f"nn.ModuleList), but {type(model).__name__} has no nn.ModuleList; set "
            "activation_checkpointing to 'none'"
        )
    wrapper = _checkpointed if mode == "full" else _selectively_checkpointed
    for _, block in blocks:
        block.forward = functools.partial(wrapper, block.forward)
    return [name for name, _ in blocks]
