"""A user's state dict as named tensors plus JSON, and back into the live objects.

``"model"`` (any ``nn.Module``) contributes ``model/<fqn>`` for every state-dict tensor, a tied
tensor (GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``) once under its first name with
the other names recorded as its aliases (``{"aliases": {alias: name}}``);
``"optimizer"`` its per-FQN state (see :mod:`optimizer_state`); ``"rng"`` (an
:class:`RNGState`) every rank's generators; anything with ``state_dict``/``load_state_dict``
(``"lr_scheduler"``, ``"data_loader"``) its state dict; anything else must be JSON-able
(tensors inside are allowed). Non-tensor state is taken from rank 0.

Example::

    tensors, objects = flatten_state({"model": model, "step": 100})
    restore = plan_restore({"model": model, "step": 0}, index, strict=True)
    ...   # read restore.targets, then restore.apply()
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vescale.dcheckpoint._collectives import gather_if_different, rank_and_world_size
from vescale.dcheckpoint.errors import CheckpointFormatError, CheckpointMismatchError
from vescale.dcheckpoint.index import CheckpointIndex
from vescale.dcheckpoint.objects import decode_object, encode_object
from vescale.dcheckpoint.optimizer_state import OptimizerRestore, encode_optimizer, merge_optimizer_encodings
from vescale.dcheckpoint.rng import RNGState

__all__ = ["StateRestore", "flatten_state", "merge_objects", "plan_restore"]

MODULE, OPTIMIZER, RNG, STATEFUL, VALUE = "module", "optimizer", "rng", "stateful", "value"


def _kind(key: str, value: Any) -> str:
    if not isinstance(key, str) or not key or "/" in key or "@" in key:
        raise CheckpointFormatError(f"state key {key!r} must be a non-empty string without '/' or '@'")
    if isinstance(value, nn.Module):
        return MODULE
    if isinstance(value, torch.optim.Optimizer):
        return OPTIMIZER
    if isinstance(value, RNGState):
        return RNG
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return STATEFUL
    return VALUE


def _model_for(state: Mapping[str, Any], key: str) -> nn.Module:
    model = state.get("model")
    if not isinstance(model, nn.Module):
        raise CheckpointFormatError(
            f"state[{key!r}] is an optimizer, whose state is keyed by parameter name: put the module it "
            'optimizes in state["model"]'
        )
    return model


def flatten_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The named tensors and the JSON objects (``{key: {"kind", "value"}}``) of a state dict.

    Example::

        tensors, objects = flatten_state({"model": nn.Linear(2, 2), "epoch": 3})
        sorted(tensors)   # ["model/bias", "model/weight"]
    """
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for key, value in state.items():
        kind = _kind(key, value)
        if kind == MODULE:
            aliases = tied_aliases(value)
            for fqn, tensor in value.state_dict().items():
                if fqn not in aliases:
                    tensors[f"{key}/{fqn}"] = tensor
            encoded = {"aliases": aliases} if aliases else None
        elif kind == OPTIMIZER:
            encoded = encode_optimizer(value, _model_for(state, key), tensors, key)
        elif kind == RNG:
            encoded = None
        elif kind == STATEFUL:
            encoded = encode_object(value.state_dict(), key, tensors)
        else:
            encoded = encode_object(value, key, tensors)
        objects[key] = {"kind": kind, "value": encoded}
    return tensors, objects


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """``{alias: name}`` for each parameter or buffer the module holds under several names.

    The first name in ``state_dict`` order keeps the tensor; later ones are its aliases.

    Example::

        tied_aliases(gpt2)   # {"lm_head.weight": "transformer.wte.weight"}
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for fqn, tensor in named:
        if tensor is None:
            continue
        name = first.setdefault(id(tensor), fqn)
        if name != fqn:
            aliases[fqn] = name
    return aliases


def _saved_aliases(key: str, index: CheckpointIndex) -> dict[str, str]:
    entry = index.objects.get(key)
    value = entry.get("value") if isinstance(entry, dict) else None
    aliases = value.get("aliases") if isinstance(value, dict) else None
    if aliases is None:
        return {}
    if not isinstance(aliases, dict) or not all(
        isinstance(alias, str) and isinstance(name, str) and f"{key}/{name}" in index.tensors
        for alias, name in aliases.items()
    ):
        raise CheckpointFormatError(f"{key!r}: its tied-tensor aliases {aliases!r} name no saved tensor")
    return {f"{key}/{alias}": f"{key}/{name}" for alias, name in aliases.items()}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    local_a = a.to_local() if isinstance(a, torch.distributed.tensor.DTensor) else a
    local_b = b.to_local() if isinstance(b, torch.distributed.tensor.DTensor) else b
    return local_a.untyped_storage().data_ptr() == local_b.untyped_storage().data_ptr()


def merge_objects(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON state of ranks that hold different parts of it: optimizers merged, else the first rank's.

    Example::

        merge_objects([stage0_objects, stage1_objects])["optimizer"]   # both stages' groups and state
    """
    merged: dict[str, Any] = {}
    for objects in per_rank:
        for key, entry in objects.items():
            if key not in merged:
                merged[key] = entry
            elif entry["kind"] == OPTIMIZER and merged[key]["kind"] == OPTIMIZER:
                value = merge_optimizer_encodings(merged[key]["value"], entry["value"])
                merged[key] = {"kind": OPTIMIZER, "value": value}
    return merged


def _names(names: set[str]) -> str:
    ordered = sorted(names)
    shown = ", ".join(repr(name) for name in ordered[:5])
    return shown + (f" and {len(ordered) - 5} more" if len(ordered) > 5 else "")


@dataclass
class _KeyUsage:
    """Of a module or optimizer entry: what the checkpoint holds, what this rank loads, what it lacks."""

    kind: str
    saved: set[str]
    used: set[str]
    missing: set[str]


@dataclass
class StateRestore:
    """Tensors to read (``targets``: name to a live or freshly allocated tensor), then :meth:`apply`."""

    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    restore_rng: bool = False
    usage: dict[str, _KeyUsage] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check_keys(self, strict: bool) -> None:
        """With ``strict``, raise on every rank if a rank lacks a saved key or no rank loads one.

        Collective: the ranks may load different parts (pipeline stages), so what is unexpected
        is what no rank loads. One digest exchange when the ranks load the same keys.

        Example::

            restore = plan_restore(state, index, strict=True)
            restore.check_keys(strict=True)
        """
        if not strict:
            return
        payload: dict[str, Any] = {
            "problems": self.problems,
            "used": {key: sorted(usage.used) for key, usage in self.usage.items()},
            "missing": {key: sorted(usage.missing) for key, usage in self.usage.items()},
        }
        gathered = gather_if_different(json.dumps(payload, sort_keys=True).encode())
        per_rank = [payload] if gathered is None else [json.loads(raw) for raw in gathered]
        several = rank_and_world_size()[1] > 1 and gathered is not None
        for rank, found in enumerate(per_rank):
            if found["problems"]:
                where = f" (on rank {rank})" if several else ""
                raise CheckpointMismatchError(found["problems"][0] + where)
        for key, usage in self.usage.items():
            missing = {name for found in per_rank for name in found["missing"].get(key, [])}
            unexpected = usage.saved - {name for found in per_rank for name in found["used"].get(key, [])}
            if not missing and not unexpected:
                continue
            found_in = f"missing {_names(missing) or 'none'}; unexpected {_names(unexpected) or 'none'}"
            if usage.kind == OPTIMIZER:
                raise CheckpointMismatchError(
                    f"optimizer parameters differ from the checkpoint's: {found_in}. Build the optimizer "
                    "over the same parameters, or pass strict=False to load the common ones"
                )
            raise CheckpointMismatchError(
                f"state[{key!r}] does not match the checkpoint: {found_in}. Build the model the "
                "checkpoint was saved from, or pass strict=False"
            )

    def apply(self) -> None:
        """Install what was read into the optimizer, stateful objects and plain values."""
        for finish in self.finishers:
            finish()


def _restore_module(key: str, module: nn.Module, index: CheckpointIndex, restore: StateRestore) -> None:
    live = {f"{key}/{fqn}": tensor for fqn, tensor in module.state_dict().items()}
    aliases = _saved_aliases(key, index)
    saved = {name for name in index.tensors if name.startswith(f"{key}/")} | set(aliases)
    restore.usage[key] = _KeyUsage(MODULE, saved, set(live) & saved, set(live) - saved)
    for name in sorted(set(live) & saved, key=lambda name: (name in aliases, name)):  # saved names first
        source = aliases.get(name, name)
        record, tensor = index.tensors[source], live[name]
        if record.shape != tuple(tensor.shape) or record.dtype != tensor.dtype:
            raise CheckpointMismatchError(
                f"{name!r}: the checkpoint holds {record.dtype} of shape {record.shape}, the model has "
                f"{tensor.dtype} of shape {tuple(tensor.shape)}; build the model with the saved configuration"
            )
        target = restore.targets.get(source)
        if target is None:
            restore.targets[source] = tensor
        elif not _same_memory(target, tensor):  # tied when saved, not in this model: a copy each
            restore.finishers.append(_copier(tensor, target))


def _copier(tensor: torch.Tensor, source: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:
        with torch.no_grad():
            tensor.copy_(source)

    return copy


def _plain_targets(key: str, index: CheckpointIndex) -> dict[str, torch.Tensor]:
    return {
        name: torch.empty(record.shape, dtype=record.dtype)
        for name, record in index.tensors.items()
        if name.startswith(f"{key}/")
    }


def plan_restore(state: MutableMapping[str, Any], index: CheckpointIndex, strict: bool) -> StateRestore:
    """What to read to load ``index`` into ``state``, checking keys, shapes and dtypes first.

    Example::

        restore = plan_restore({"model": model}, index, strict=True)
        sorted(restore.targets)   # ["model/bias", "model/weight"]
    """
    restore = StateRestore()
    for key, value in state.items():
        kind = _kind(key, value)
        saved = index.objects.get(key)
        if saved is None:
            if strict:
                raise CheckpointMismatchError(
                    f"the checkpoint has no {key!r} (it holds {_names(set(index.objects)) or 'nothing'}); "
                    "remove it from the state or pass strict=False"
                )
            continue
        if not isinstance(saved, dict) or saved.get("kind") != kind:
            saved_kind = saved.get("kind") if isinstance(saved, dict) else None
            raise CheckpointMismatchError(
                f"state[{key!r}] is of kind {kind!r} but the checkpoint saved it as kind {saved_kind!r}; "
                "pass an object of the saved kind"
            )
        if kind == MODULE:
            _restore_module(key, value, index, restore)
        elif kind == OPTIMIZER:
            shapes = {n: (r.shape, r.dtype) for n, r in index.tensors.items() if n.startswith(f"{key}/")}
            model = _model_for(state, key)
            optimizer_restore = OptimizerRestore(value, model, saved.get("value"), shapes, key)
            restore.usage[key] = _KeyUsage(
                OPTIMIZER, optimizer_restore.saved, optimizer_restore.used, optimizer_restore.missing
            )
            if optimizer_restore.grouping_problem is not None:
                restore.problems.append(optimizer_restore.grouping_problem)
            restore.targets.update(optimizer_restore.targets)
            restore.finishers.append(optimizer_restore.apply)
        elif kind == RNG:
            restore.restore_rng = True
        else:
            targets = _plain_targets(key, index)
            restore.targets.update(targets)
            restore.finishers.append(_object_finisher(state, key, value, kind, saved.get("value"), targets))
    return restore


def _object_finisher(
    state: MutableMapping[str, Any],
    key: str,
    value: Any,
    kind: str,
    encoded: Any,
    targets: Mapping[str, torch.Tensor],
) -> Callable[[], None]:
    def finish() -> None:
        decoded = decode_object(encoded, targets, key)
        if kind == STATEFUL:
            value.load_state_dict(decoded)
        else:
            state[key] = decoded

    return finish
