"""``vescale.save`` / ``vescale.load``: a whole training state on top of ``vescale.dcheckpoint``.

``state = {"plan": Plan, "model": module, "optimizer": ..., "lr_scheduler": ..., "data_loader": ...}``
(every key but ``"model"`` optional; other keys go to ``vescale.dcheckpoint`` as they are). The
model's tensors are saved in their parallel layout and load into any other (dcheckpoint's
resharding); the plan is kept as its JSON text; the LR scheduler and data loader as their JSON
state dicts. Nothing on disk is pickled.

Random numbers resume too: ``vescale.save`` also saves every rank's generator states (torch's,
the accelerator's, Python's and NumPy's: ``vescale.dcheckpoint.RNGState``) and ``vescale.load``
puts them back when the checkpoint holds them, so a resumed run draws the dropout masks the
uninterrupted run draws (veScale keeps every rank's torch generator where one device's is, so a
checkpoint loads under any world size). ``"rng": None`` in the state leaves them out: not saved,
or not restored.

A ``vescale.doptim.DistributedOptimizer`` is saved through its ``checkpoint_view()``: its state
per model parameter, as DTensors sharded over dp (each rank holds and writes 1/dp of it), so it
loads under any dp size, ZeRO stage, tensor-parallel plan and pipeline split. Any other
optimizer goes to dcheckpoint as an optimizer (per FQN, in its parameters' layout). Pipeline-
parallel models save the tensors of each rank's stages under the model's own FQNs
(dcheckpoint agrees on the union over the ranks), so a checkpoint saved under one pipeline size
loads under another, or without a pipeline. Under ``mixed_precision="bf16"`` the optimizer
state includes the fp32 master weights (``"master_weight"``), so a bf16 run resumes exactly.

Example::

    vescale.save("ckpt/step-000100", {"plan": plan, "model": model, "optimizer": optimizer})
    plan = vescale.load("ckpt", {"model": model, "optimizer": optimizer})  # ckpt/latest, any plan
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from vescale.api._global_batch import ParallelizedModel
from vescale.api.errors import VescaleAPIError
from vescale.dcheckpoint import AsyncSave, CheckpointFormatError, RNGState, SaveResult, read_index
from vescale.dcheckpoint import load as load_checkpoint
from vescale.dcheckpoint import save as save_checkpoint
from vescale.dcheckpoint.async_save import wait_for_pending_save
from vescale.dcheckpoint.atomic import resolve_checkpoint
from vescale.doptim import DistributedOptimizer
from vescale.planner import Plan, PlanFormatError

__all__ = ["CheckpointStateError", "load", "save"]

PLAN_KEY = "plan"
RNG_KEY = "rng"


class CheckpointStateError(VescaleAPIError, ValueError):
    """The state handed to ``vescale.save``/``vescale.load`` is not one they can save or fill."""


def _module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise CheckpointStateError(
            f'state["model"] must be the model (an nn.Module, e.g. the one vescale.parallelize returned), '
            f"got {type(model).__name__}"
        )
    # The wrapper's parameters are named "module.<fqn>"; the user's model names them "<fqn>", which is
    # what the optimizer state and the checkpoint use.
    return model.module if isinstance(model, ParallelizedModel) else model


def _checkpoint_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state as dcheckpoint takes it: the bare model, adapted optimizer, everything else as is."""
    if not isinstance(state, Mapping) or "model" not in state:
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointStateError(
            f'the state must be a dict with at least "model" (and optionally "plan", "optimizer", '
            f'"lr_scheduler", "data_loader"), got {found}'
        )
    checkpoint_state: dict[str, Any] = {}
    for key, value in state.items():
        if key == PLAN_KEY or (key == RNG_KEY and value is None):
            continue
        if key == "model":
            value = _module(value)
        elif isinstance(value, DistributedOptimizer):
            # Collective (it gathers ZeRO's ranges one bucket at a time); loading into it writes through.
            value = value.checkpoint_view()
        checkpoint_state[key] = value
    return checkpoint_state


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    async_save: bool = False,
    keep_last: int | None = None,
    defer_copies: bool = False,
) -> SaveResult | AsyncSave:
    """Save ``state`` (see the module docstring) to the new checkpoint directory ``path``, on every rank.

    ``async_save``, ``keep_last`` and ``defer_copies`` are ``vescale.dcheckpoint.save``'s: return
    once the state is copied (an ``AsyncSave``); delete all but the ``keep_last`` newest complete
    checkpoints; with ``defer_copies=True`` (async only) return before the parameters are copied,
    which the saving thread copies while the next forward and backward run (the next optimizer
    step waits for them), so that not even the first async save of a process blocks on faulting
    in its staging memory. Until that step, change the parameters only through optimizer steps.

    Example::

        state = {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
        vescale.save("ckpt/step-000100", {**state, "data_loader": loader})
        vescale.save("ckpt/step-000200", state, async_save=True, defer_copies=True)
    """
    checkpoint_state = _checkpoint_state(state)
    if RNG_KEY not in state:
        checkpoint_state[RNG_KEY] = RNGState()
    if PLAN_KEY in state:
        plan = state[PLAN_KEY]
        if not isinstance(plan, Plan):
            raise CheckpointStateError(
                f'state["plan"] must be a vescale.Plan (the one the run was parallelized with), got '
                f"{type(plan).__name__}; drop the key to save no plan"
            )
        checkpoint_state[PLAN_KEY] = plan.to_json(indent=None)
    return save_checkpoint(
        path, checkpoint_state, async_save=async_save, keep_last=keep_last, defer_copies=defer_copies
    )


def _saved_plan(index_objects: Mapping[str, Any], where: str) -> Plan | None:
    entry = index_objects.get(PLAN_KEY)
    if entry is None:
        return None
    text = entry.get("value") if isinstance(entry, dict) else None
    if not isinstance(text, str):
        raise CheckpointFormatError(f"{where}: the saved plan is not the JSON text vescale.save writes")
    try:
        return Plan.from_json(text)
    except PlanFormatError as error:
        raise CheckpointFormatError(f"{where}: the saved plan does not parse: {error}") from error


def load(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Plan | None:
    """Fill the objects of ``state`` in place from the checkpoint at ``path``; return the saved plan.

    ``path`` is a checkpoint directory or its parent (whose ``latest`` names one). The objects
    keep their current layout: a checkpoint saved under one plan loads under another. The
    ``"plan"`` entry of ``state``, if any, is not changed; the saved one is returned (``None``
    when the checkpoint holds none).

    Example::

        model, optimizer, scheduler, loader = vescale.parallelize(new_plan, model, optimizer_fn, ...)
        saved_plan = vescale.load("ckpt", {"model": model, "optimizer": optimizer, "data_loader": loader})
    """
    checkpoint_state = _checkpoint_state(state)
    wait_for_pending_save()  # an async save to ``path`` may not have written its index yet
    directory = resolve_checkpoint(Path(path))
    index = read_index(directory)  # read once: its rng states and its plan
    if RNG_KEY not in state and index.rng:
        checkpoint_state[RNG_KEY] = RNGState()
    load_checkpoint(directory, checkpoint_state)
    return _saved_plan(index.objects, str(directory))
