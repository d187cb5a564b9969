"""User constraints on a plan: a flat dict of dotted keys, each of which wins over the planner.

Every key is optional; a key that is set is obeyed or the plan is refused with a
:class:`~vescale.planner.errors.ConstraintError` that says why. Nested dicts are accepted too
and read as dotted keys (``{"zero": {"stage": 2}}`` is ``{"zero.stage": 2}``).

========================================  =====================================================
key                                       meaning
========================================  =====================================================
``data_parallel.size``                    data-parallel ranks
``tensor_parallel.size``                  tensor-parallel ranks (within a node)
``pipeline_parallel.size``                pipeline stages
``expert_parallel.size``                  expert-parallel ranks: the experts of every MoE block are
                                          sharded over them (E/ep each), the batch over dp x ep
``expert_tensor_parallel``                true: the tensor-parallel plan splits the experts too;
                                          false: tensor parallelism only outside the experts
``expert_parallel.capacity_factor``       tokens per expert capped at factor x its even share
                                          (dropped deterministically); default dropless
``sequence_parallel``                     shard activations between blocks on the sequence
``zero.stage``                            0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ params)
``tensor_parallel.sharding_policy``       ``"megatron"``
``pipeline_parallel.split_method``        ``"uniform"``, ``"params"``, ``"flops"`` or ``"manual"``
``pipeline_parallel.split_points``        module FQNs that start a stage (with ``"manual"``)
``pipeline_parallel.schedule``            ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``,
                                          ``"zbv"`` (two stages per rank in a V; chosen only when set)
``pipeline_parallel.virtual_stages``      stages per rank (``interleaved_1f1b``, ``zero_bubble``; ``zbv``: 2)
``pipeline_parallel.num_microbatches``    micro-batches per pipeline step
``memory_per_device_gb``                  memory a device may use (default: the device's)
``devices_per_node``                      devices per node (tensor parallel stays inside one)
``global_batch_size``                     samples per optimizer step, over all data-parallel ranks
``micro_batch_size``                      samples per forward; smaller than the dp share accumulates
``sequence_length``                       tokens per sample, for memory estimates
``mixed_precision``                       ``"fp32"`` or ``"bf16"`` (fp32 master weights and state)
``activation_checkpointing``              ``"none"``, ``"full"`` or ``"selective"``, per repeated block
``data_parallel.deterministic``           sum gradients in rank order (bitwise-reproducible restarts)
``hardware``                              a profile name (``"h100-80gb"``, ``"cpu"``) or JSON file: the
                                          planner then searches for the fastest plan (cost model)
========================================  =====================================================

Example::

    constraints = Constraints.from_dict({"tensor_parallel.size": 2, "zero.stage": 1})
    constraints.check_world_size(8)          # dp is left to the planner: 8 / 2 = 4 is possible
    print(constraints.to_dict())             # {'tensor_parallel.size': 2, 'zero.stage': 1}
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

from vescale.planner.errors import ConstraintError

__all__ = ["CONSTRAINT_KEYS", "Constraints"]

_CHOICES = {
    "tensor_parallel.sharding_policy": ("megatron",),
    "pipeline_parallel.split_method": ("uniform", "params", "flops", "manual"),
    "pipeline_parallel.schedule": ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"),
    "mixed_precision": ("fp32", "bf16"),
    "activation_checkpointing": ("none", "full", "selective"),
}
_POSITIVE_INTS = (
    "data_parallel.size",
    "tensor_parallel.size",
    "pipeline_parallel.size",
    "expert_parallel.size",
    "pipeline_parallel.num_microbatches",
    "pipeline_parallel.virtual_stages",
    "devices_per_node",
    "global_batch_size",
    "micro_batch_size",
    "sequence_length",
)


@dataclasses.dataclass(frozen=True)
class Constraints:
    """The constraints a user set (``None``: the planner decides). Build with :meth:`from_dict`."""

    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    expert_tensor_parallel: bool | None = None
    expert_parallel_capacity_factor: float | None = None
    sequence_parallel: bool | None = None
    zero_stage: int | None = None
    tensor_parallel_sharding_policy: str | None = None
    pipeline_parallel_split_method: str | None = None
    pipeline_parallel_split_points: tuple[str, ...] | None = None
    pipeline_parallel_schedule: str | None = None
    pipeline_parallel_num_microbatches: int | None = None
    pipeline_parallel_virtual_stages: int | None = None
    memory_per_device_gb: float | None = None
    devices_per_node: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    sequence_length: int | None = None
    mixed_precision: str | None = None
    activation_checkpointing: str | None = None
    data_parallel_deterministic: bool | None = None
    hardware: str | None = None

    @classmethod
    def from_dict(cls, constraints: Mapping[str, Any] | Constraints | None) -> Constraints:
        """Parse and check a dict of dotted keys (or nested dicts); ``None`` means no constraint.

        Example::

            Constraints.from_dict({"pipeline_parallel": {"size": 2, "schedule": "1f1b"}})
        """
        if constraints is None:
            return cls()
        if isinstance(constraints, Constraints):
            return constraints
        if not isinstance(constraints, Mapping):
            raise ConstraintError(
                f"constraints must be a dict of dotted keys, e.g. {{'tensor_parallel.size': 2}}; "
                f"got {type(constraints).__name__}"
            )
        values = {}
        for key, value in _flatten(constraints).items():
            if key not in CONSTRAINT_KEYS:
                raise ConstraintError(_unknown_key_message(key))
            values[CONSTRAINT_KEYS[key]] = _checked_value(key, value)
        result = cls(**values)
        result._check_combinations()
        return result

    def to_dict(self) -> dict[str, Any]:
        """The constraints that are set, as a flat dict of dotted keys (JSON-able).

        Example::

            assert Constraints.from_dict(c.to_dict()) == c
        """
        flat = {}
        for key, field_name in CONSTRAINT_KEYS.items():
            value = getattr(self, field_name)
            if value is not None:
                flat[key] = list(value) if isinstance(value, tuple) else value
        return flat

    def check_world_size(self, world_size: int) -> None:
        """Refuse parallel sizes that cannot multiply to ``world_size``.

        Example::

            Constraints.from_dict({"tensor_parallel.size": 3}).check_world_size(8)   # ConstraintError
        """
        sizes = {
            "data_parallel.size": self.data_parallel_size,
            "tensor_parallel.size": self.tensor_parallel_size,
            "pipeline_parallel.size": self.pipeline_parallel_size,
        }
        given = {key: size for key, size in sizes.items() if size is not None}
        if self.expert_parallel_size is not None:
            given["expert_parallel.size"] = self.expert_parallel_size
        product = math.prod(given.values())
        described = " x ".join(f"{key}={size}" for key, size in given.items())
        if all(size is not None for size in sizes.values()) and product != world_size:
            raise ConstraintError(
                f"{described} = {product} devices, but the world size is {world_size}; "
                "make the sizes multiply to the world size, or leave one of them to the planner"
            )
        if world_size % product:
            raise ConstraintError(
                f"{described} = {product} does not divide the world size {world_size}; "
                f"choose sizes whose product divides {world_size}"
            )

    @property
    def stages_per_pipeline_rank(self) -> int:
        """``pipeline_parallel.virtual_stages``, else what the schedule implies (2 for ZBV, else 1)."""
        return self.pipeline_parallel_virtual_stages or (2 if self.pipeline_parallel_schedule == "zbv" else 1)

    def _check_virtual_stages(self) -> None:
        schedule, virtual = self.pipeline_parallel_schedule, self.pipeline_parallel_virtual_stages
        if schedule in ("gpipe", "1f1b") and virtual not in (None, 1):
            raise ConstraintError(
                f"pipeline_parallel.schedule={schedule!r} runs one stage per rank, but "
                f"pipeline_parallel.virtual_stages={virtual}; use 'interleaved_1f1b', 'zero_bubble' or "
                "'zbv' for several stages per rank, or drop virtual_stages"
            )
        if schedule == "zbv" and virtual not in (None, 2):
            raise ConstraintError(
                f"pipeline_parallel.schedule='zbv' places exactly 2 stages per rank in a V, but "
                f"pipeline_parallel.virtual_stages={virtual}; set virtual_stages to 2 or drop it"
            )

    def _check_combinations(self) -> None:
        method, points = self.pipeline_parallel_split_method, self.pipeline_parallel_split_points
        if method == "manual" and not points:
            raise ConstraintError(
                "pipeline_parallel.split_method='manual' needs pipeline_parallel.split_points "
                "(the module FQNs that start each stage after the first)"
            )
        if points and method not in (None, "manual"):
            raise ConstraintError(
                f"pipeline_parallel.split_points are given with split_method={method!r}; "
                "drop the split points or set pipeline_parallel.split_method='manual'"
            )
        self._check_virtual_stages()
        virtual = self.stages_per_pipeline_rank
        if (
            points
            and self.pipeline_parallel_size is not None
            and len(points) + 1 != self.pipeline_parallel_size * virtual
        ):
            raise ConstraintError(
                f"{len(points)} pipeline_parallel.split_points make {len(points) + 1} stages, but "
                f"pipeline_parallel.size={self.pipeline_parallel_size} x virtual_stages={virtual} stages "
                "are needed; give size x virtual_stages - 1 split points"
            )
        if (
            self.zero_stage == 3
            and self.pipeline_parallel_size is not None
            and self.pipeline_parallel_size > 1
        ):
            raise ConstraintError(
                f"zero.stage=3 with pipeline_parallel.size={self.pipeline_parallel_size}: ZeRO-3 under a "
                "pipeline is not supported; use zero.stage 1 or 2 (each shards the optimizer state over "
                "dp) or pipeline_parallel.size=1"
            )
        if self.pipeline_parallel_size == 1 and (
            self.pipeline_parallel_schedule or points or self.pipeline_parallel_virtual_stages
        ):
            raise ConstraintError(
                "pipeline_parallel.size=1 has no stages to schedule or split; drop the pipeline_parallel "
                "schedule/split/virtual_stages keys or raise pipeline_parallel.size"
            )
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ConstraintError(
                "sequence_parallel=True shards activations over the tensor-parallel ranks, but "
                "tensor_parallel.size=1; raise tensor_parallel.size or drop sequence_parallel"
            )
        if self.expert_tensor_parallel and self.tensor_parallel_size == 1:
            raise ConstraintError(
                "expert_tensor_parallel=True splits the experts over the tensor-parallel ranks, but "
                "tensor_parallel.size=1; raise tensor_parallel.size or drop expert_tensor_parallel"
            )
        if self.expert_parallel_capacity_factor is not None and self.expert_parallel_size == 1:
            raise ConstraintError(
                "expert_parallel.capacity_factor caps the tokens dispatched to each expert, but "
                "expert_parallel.size=1 dispatches none; raise expert_parallel.size or drop the factor"
            )
        tp, per_node = self.tensor_parallel_size, self.devices_per_node
        if tp is not None and per_node is not None and tp > per_node:
            raise ConstraintError(
                f"tensor_parallel.size={tp} is larger than devices_per_node={per_node}; tensor "
                "parallelism stays inside a node (its all-reduces are per layer), lower it"
            )
        global_batch, micro_batch = self.global_batch_size, self.micro_batch_size
        if global_batch is not None and micro_batch is not None:
            dp = self.data_parallel_size
            if dp is not None:
                dp *= self.expert_parallel_size or 1
            share = global_batch // dp if dp is not None and global_batch % dp == 0 else None
            if dp is not None and share is None:
                raise ConstraintError(
                    f"global_batch_size={global_batch} does not split over data_parallel.size x "
                    f"expert_parallel.size = {dp} batch ranks; make it a multiple of that"
                )
            if share is not None and share % micro_batch:
                raise ConstraintError(
                    f"micro_batch_size={micro_batch} does not divide the per-rank share {share} of "
                    f"global_batch_size={global_batch} over data_parallel.size={dp}"
                )


CONSTRAINT_KEYS: dict[str, str] = {
    field.name.replace("_parallel_", "_parallel.").replace("zero_", "zero."): field.name
    for field in dataclasses.fields(Constraints)
}
"""Dotted key -> field of :class:`Constraints`."""


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, CONSTRAINT_KEYS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"the keys are: {', '.join(CONSTRAINT_KEYS)}"
    return f"unknown constraint {key!r}; {hint}"


def _checked_value(key: str, value: Any) -> Any:
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise ConstraintError(f"constraint {key}={value!r} is not one of {list(_CHOICES[key])}")
        return value
    if key in _POSITIVE_INTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConstraintError(f"constraint {key}={value!r} must be a positive integer")
        return value
    if key == "zero.stage":
        if isinstance(value, bool) or value not in (0, 1, 2, 3):
            raise ConstraintError(f"constraint zero.stage={value!r} must be 0, 1, 2 or 3")
        return value
    if key in ("sequence_parallel", "data_parallel.deterministic", "expert_tensor_parallel"):
        if not isinstance(value, bool):
            raise ConstraintError(f"constraint {key}={value!r} must be true or false")
        return value
    if key == "hardware":
        if not isinstance(value, str) or not value:
            raise ConstraintError(
                f"constraint hardware={value!r} must be a profile name (e.g. 'h100-80gb') or a JSON file path"
            )
        return value
    if key in ("memory_per_device_gb", "expert_parallel.capacity_factor"):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConstraintError(f"constraint {key}={value!r} must be a positive number")
        return float(value)
    # pipeline_parallel.split_points, the one key left
    is_list = isinstance(value, list | tuple)
    if not is_list or not all(isinstance(point, str) for point in value):
        raise ConstraintError(
            f"constraint {key}={value!r} must be a list of module FQNs, e.g. ['model.layers.2']"
        )
    return tuple(value)
