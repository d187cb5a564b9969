"""A ``torch.optim.Optimizer``'s state keyed by parameter FQN instead of by position.

Torch numbers parameters by their order in the param groups, which changes with the model's
parallel plan; FQNs do not. Each parameter's state tensors keep the layout torch gives them
(a DTensor parameter's ``exp_avg`` is a DTensor of the same placements), so they reshard like
the parameter. On load, state that the optimizer has not created yet is allocated from the
checkpoint's shapes and dtypes: like the parameter when the saved tensor has its shape.

Example::

    tensors = {}
    encoded = encode_optimizer(optimizer, model, tensors)   # tensors["optimizer/state/fc.weight/exp_avg"]
    restore = OptimizerRestore(optimizer, model, encoded, saved_tensors)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from vescale.dcheckpoint.errors import CheckpointFormatError
from vescale.dcheckpoint.objects import decode_object, encode_object

__all__ = ["OptimizerRestore", "encode_optimizer", "merge_optimizer_encodings"]


def _param_fqns(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[str]]:
    fqn_by_id = {id(param): fqn for fqn, param in model.named_parameters()}
    groups = []
    for group_index, group in enumerate(optimizer.param_groups):
        fqns = []
        for param in group["params"]:
            if id(param) not in fqn_by_id:
                raise CheckpointFormatError(
                    f"optimizer param group {group_index} holds a parameter of shape {tuple(param.shape)} "
                    'that is not a parameter of state["model"]; save the model the optimizer was built over'
                )
            fqns.append(fqn_by_id[id(param)])
        groups.append(fqns)
    return groups


def encode_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    key: str = "optimizer",
) -> Any:
    """JSON for the optimizer's groups and per-FQN state; its state tensors are added to ``tensors``.

    Example::

        tensors = {}
        encoded = encode_optimizer(optimizer, model, tensors)
        encoded["param_groups"][0]["params"]   # ["fc.weight", "fc.bias"]
    """
    groups = []
    state = {}
    for index, (fqns, group) in enumerate(
        zip(_param_fqns(optimizer, model), optimizer.param_groups, strict=True)
    ):
        hyperparameters = {key: value for key, value in group.items() if key != "params"}
        encoded = encode_object(hyperparameters, f"{key}/groups/{index}", tensors)
        groups.append({"params": fqns, "hyperparameters": encoded})
        for fqn, param in zip(fqns, group["params"], strict=True):
            if param in optimizer.state:
                state[fqn] = encode_object(dict(optimizer.state[param]), f"{key}/state/{fqn}", tensors)
    return {"param_groups": groups, "state": state}


def merge_optimizer_encodings(first: Any, second: Any) -> Any:
    """One encoding of two ranks' optimizers over different parameters (pipeline stages).

    Group ``i`` holds the parameters of both ranks' group ``i`` (``first``'s first) with
    ``first``'s hyper-parameters; the per-FQN state is the union.

    Example::

        merged = merge_optimizer_encodings(stage0_encoded, stage1_encoded)
        merged["param_groups"][0]["params"]   # stage 0's FQNs, then stage 1's
    """
    if not isinstance(first, dict) or not isinstance(second, dict):
        raise CheckpointFormatError("an optimizer entry to merge is not a mapping")
    groups = [dict(group) for group in first.get("param_groups", [])]
    for index, group in enumerate(second.get("param_groups", [])):
        if index >= len(groups):
            groups.append(dict(group))
            continue
        known = set(groups[index]["params"])
        groups[index]["params"] = groups[index]["params"] + [p for p in group["params"] if p not in known]
    return {"param_groups": groups, "state": {**second.get("state", {}), **first.get("state", {})}}


def _names(fqns: set[str] | list[str]) -> str:
    fqns = sorted(fqns)
    return ", ".join(repr(fqn) for fqn in fqns[:5]) + (f" and {len(fqns) - 5} more" if len(fqns) > 5 else "")


class OptimizerRestore:
    """Targets to read the optimizer's state tensors into, then :meth:`apply` to install them."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        encoded: Any,
        saved_tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        key: str = "optimizer",
    ) -> None:
        if not isinstance(encoded, dict) or not isinstance(encoded.get("param_groups"), list):
            raise CheckpointFormatError("the index's optimizer entry has no param_groups list")
        self.optimizer, self.encoded, self.key = optimizer, encoded, key
        self.current_groups = _param_fqns(optimizer, model)
        saved_groups = [
            group.get("params") if isinstance(group, dict) else None for group in encoded["param_groups"]
        ]
        current = {fqn for fqns in self.current_groups for fqn in fqns}
        saved = {
            fqn for fqns in saved_groups if isinstance(fqns, list) for fqn in fqns if isinstance(fqn, str)
        }
        # Per-FQN coverage is checked over all ranks together (StateRestore.check_keys): a pipeline
        # stage's optimizer holds only its own parameters.
        self.used, self.missing, self.saved = current & saved, current - saved, saved
        # Each group holds a subset of the saved group of the same index (all of it on one rank,
        # its stage's part under a pipeline); then the saved hyper-parameters apply to it.
        self.groups_match = len(saved_groups) == len(self.current_groups) and all(
            isinstance(saved_fqns, list) and set(fqns) <= set(saved_fqns)
            for fqns, saved_fqns in zip(self.current_groups, saved_groups, strict=False)
        )
        self.grouping_problem = (
            None
            if self.groups_match
            else "optimizer param groups hold the parameters in another grouping than the checkpoint's "
            f"({len(saved_groups)} saved groups, {len(self.current_groups)} now); build the same groups"
        )
        params = {fqn: param for fqn, param in model.named_parameters()}
        self.targets: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in saved_tensors.items():
            if name.startswith(f"{key}/groups/"):
                self.targets[name] = torch.empty(shape, dtype=dtype)
                continue
            fqn = name.removeprefix(f"{key}/state/").split("/", 1)[0]
            if not name.startswith(f"{key}/state/") or fqn not in current:
                continue
            param = params[fqn].detach()
            if tuple(param.shape) == shape:
                self.targets[name] = torch.empty_like(param, dtype=dtype)
            else:
                self.targets[name] = torch.empty(shape, dtype=dtype, device=_local_device(param))

    def apply(self) -> None:
        """Install the loaded state and hyperparameters in the optimizer."""
        params = {
            fqn: param
            for fqns, group in zip(self.current_groups, self.optimizer.param_groups, strict=True)
            for fqn, param in zip(fqns, group["params"], strict=True)
        }
        saved_state = self.encoded.get("state")
        if not isinstance(saved_state, dict):
            raise CheckpointFormatError("the index's optimizer entry has no state mapping")
        for fqn, encoded_state in saved_state.items():
            if fqn in params:
                decoded = decode_object(encoded_state, self.targets, f"{self.key}/state/{fqn}")
                if not isinstance(decoded, dict):
                    raise CheckpointFormatError(f"optimizer state of {fqn!r} in the index is not a mapping")
                self.optimizer.state[params[fqn]] = decoded
        if self.groups_match:
            for group, saved in zip(self.optimizer.param_groups, self.encoded["param_groups"], strict=True):
                encoded = saved.get("hyperparameters") if isinstance(saved, dict) else None
                hyperparameters = decode_object(encoded, self.targets, f"{self.key}/groups")
                if not isinstance(hyperparameters, dict):
                    raise CheckpointFormatError("optimizer hyperparameters in the index are not a mapping")
                group.update(hyperparameters)


def _local_device(param: torch.Tensor) -> torch.device:
    to_local: Callable[[], torch.Tensor] | None = getattr(param, "to_local", None)
    return to_local().device if to_local is not None else param.device
