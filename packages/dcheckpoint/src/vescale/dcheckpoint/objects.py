"""Plain Python state (scheduler and loader state, optimizer hyperparameters, extras) as JSON.

Values become JSON as they are; tuples, dicts with non-string keys and tensors become tagged
objects, so that what is loaded equals what was saved (``betas`` stays a tuple). Tensors are
taken out and stored in the shard files under a name derived from where they were.

Example::

    tensors = {}
    encoded = encode_object({"step": torch.tensor(3), "betas": (0.9, 0.99)}, "sched", tensors)
    decode_object(encoded, tensors, "sched") == {"step": tensors["sched/step"], "betas": (0.9, 0.99)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vescale.dcheckpoint.errors import CheckpointFormatError

__all__ = ["decode_object", "encode_object"]

_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"


def encode_object(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for ``value``; its tensors are added to ``tensors`` under names starting with ``name``.

    Example::

        tensors = {}
        encode_object({"t": torch.ones(2)}, "extra", tensors)  # {"t": {"__tensor__": "extra/t"}}
        list(tensors)                                          # ["extra/t"]
    """
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return {_TENSOR: name}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [encode_object(item, f"{name}/{index}", tensors) for index, item in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [encode_object(item, f"{name}/{index}", tensors) for index, item in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: encode_object(item, f"{name}/{key}", tensors) for key, item in value.items()}
        return {
            _DICT: [
                [
                    encode_object(key, f"{name}/key{index}", tensors),
                    encode_object(item, f"{name}/{key}", tensors),
                ]
                for index, (key, item) in enumerate(value.items())
            ]
        }
    raise CheckpointFormatError(
        f"cannot save {name!r}: a {type(value).__name__} is neither a tensor nor JSON-able, and checkpoints "
        "hold no pickle. Store it as numbers/strings/lists/dicts, or give it state_dict()/load_state_dict()"
    )


def decode_object(encoded: Any, tensors: Mapping[str, torch.Tensor], name: str) -> Any:
    """The value ``encode_object`` encoded, its tensors looked up in ``tensors``.

    Example::

        decode_object({"__tuple__": [1, 2]}, {}, "extra")   # (1, 2)
        decode_object({"__tensor__": "extra/t"}, {"extra/t": t}, "extra")  # t
    """
    if encoded is None or isinstance(encoded, bool | int | float | str):
        return encoded
    if isinstance(encoded, list):
        return [decode_object(item, tensors, name) for item in encoded]
    if not isinstance(encoded, dict):
        raise CheckpointFormatError(f"{name!r}: unexpected {type(encoded).__name__} in the index")
    if set(encoded) == {_TENSOR}:
        tensor_name = encoded[_TENSOR]
        if not isinstance(tensor_name, str) or tensor_name not in tensors:
            raise CheckpointFormatError(f"{name!r} refers to tensor {tensor_name!r}, which the index lacks")
        return tensors[tensor_name]
    if set(encoded) == {_TUPLE} and isinstance(encoded[_TUPLE], list):
        return tuple(decode_object(item, tensors, name) for item in encoded[_TUPLE])
    if set(encoded) == {_DICT} and isinstance(encoded[_DICT], list):
        pairs = encoded[_DICT]
        if not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
            raise CheckpointFormatError(f"{name!r}: a dict entry in the index is not a [key, value] pair")
        decoded = {}
        for key, item in pairs:
            key = decode_object(key, tensors, name)
            if isinstance(key, list | dict | torch.Tensor):
                raise CheckpointFormatError(f"{name!r}: a dict key in the index is not hashable")
            decoded[key] = decode_object(item, tensors, name)
        return decoded
    return {key: decode_object(item, tensors, name) for key, item in encoded.items()}
