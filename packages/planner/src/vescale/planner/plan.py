"""The ``Plan`` of an n-D parallel run: one frozen object, plain data, exact JSON round trip.

Each section belongs to the package that applies it (dmodule's ``ShardingPlan``, dpipe's
``PipelinePlan``, doptim's ``DataParallelPlan``); the plan assembles them with the mesh, the
micro-batching, activation checkpointing, the memory estimate and the reason for each choice.
Nothing in it refers to a live model or process group, so a later cost-model search can build
plans by the thousand, and a user can edit the JSON and hand it back.

Example::

    plan = generate_plan(model, {"tensor_parallel.size": 2}, world_size=8)
    print(plan); print(plan.explain())
    assert Plan.from_json(plan.to_json()) == plan
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vescale.dmodule.sharding_plan import ShardingPlan
from vescale.doptim.plan import DataParallelPlan
from vescale.dpipe.plan import PipelinePlan
from vescale.planner._plan_format import (
    ACTIVATION_CHECKPOINTING,
    MESH_DIMS,
    PLAN_FORMAT,
    SECTION_ERRORS,
    TOP_LEVEL_KEYS,
)
from vescale.planner._plan_parsing import plan_fields_from_dict
from vescale.planner._plan_table import format_plan_table
from vescale.planner.errors import PlanFormatError
from vescale.planner.memory import MemoryEstimate, ParallelChoices
from vescale.planner.performance import Performance

__all__ = ["ACTIVATION_CHECKPOINTING", "MESH_DIMS", "PLAN_FORMAT", "SECTION_ERRORS", "Plan"]


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanFormatError(f"plan field {where} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Plan:
    """A whole parallel run (see the module docstring); ``generate_plan`` builds one.

    ``mesh`` holds every dimension of :data:`MESH_DIMS` in that order (size 1 when unused).
    The batch is split over dp x ep (an expert-parallel rank is a data-parallel rank for every
    non-expert parameter): ``num_microbatches`` micro-batches of ``micro_batch_size`` samples make
    one dp x ep rank's share of ``global_batch_size``: accumulated gradients, or the pipeline's
    micro-batches when ``pp > 1``. With ``mesh.ep > 1`` the experts of every MoE block are
    sharded over ``ep`` (E/ep whole experts per rank); ``expert_tensor_parallel`` says whether
    the tensor-parallel plan also splits the experts (else TP stays outside them; ``None``, the
    default: split when ``ep == 1``, outside when ``ep > 1``, see :attr:`experts_split_over_tp`), and
    ``capacity_factor`` caps the tokens per expert (``None``: dropless).

    Example::

        plan = Plan(mesh={"dp": 2}, data_parallel=DataParallelPlan(size=2), global_batch_size=8)
        plan.num_microbatches   # 4 (micro_batch_size 1)
    """

    mesh: tuple[tuple[str, int], ...]
    data_parallel: DataParallelPlan
    global_batch_size: int
    micro_batch_size: int = 1
    sequence_length: int = 128
    sharding_plan: ShardingPlan | None = None
    sequence_parallel: bool = False
    pipeline: PipelinePlan | None = None
    activation_checkpointing: str = "none"
    memory_per_device_gb: float | None = None
    memory_estimate: MemoryEstimate | None = None
    reasons: tuple[tuple[str, str], ...] = field(default=())
    performance: Performance | None = None
    expert_tensor_parallel: bool | None = None
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        sizes = dict(self.mesh) if not isinstance(self.mesh, dict) else self.mesh
        unknown = sorted(set(sizes) - set(MESH_DIMS))
        if unknown:
            raise PlanFormatError(
                f"plan field mesh has unknown dimension(s) {unknown}; the dims are {MESH_DIMS}"
            )
        mesh = tuple((dim, _positive_int(sizes.get(dim, 1), f"mesh.{dim}")) for dim in MESH_DIMS)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "reasons", tuple((str(k), str(v)) for k, v in dict(self.reasons).items()))
        if self.data_parallel.size != self.mesh_size("dp"):
            raise PlanFormatError(
                f"plan field data_parallel.size={self.data_parallel.size} differs from mesh.dp="
                f"{self.mesh_size('dp')}; make them equal"
            )
        self._check_tensor_parallel()
        self._check_expert_parallel()
        self._check_batches()
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise PlanFormatError(
                f"plan field activation_checkpointing={self.activation_checkpointing!r} is not one of "
                f"{list(ACTIVATION_CHECKPOINTING)}"
            )
        budget = self.memory_per_device_gb
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0
        ):
            raise PlanFormatError(
                f"plan field memory.memory_per_device_gb must be a positive number, got {budget!r}"
            )

    def _check_tensor_parallel(self) -> None:
        tp = self.mesh_size("tp")
        if tp > 1 and self.sharding_plan is None:
            raise PlanFormatError(
                f"plan field tensor_parallel.sharding_plan is missing but mesh.tp={tp}; give a sharding "
                "plan (e.g. from vescale.dmodule.plan_tensor_parallel) or set mesh.tp to 1"
            )
        if tp == 1 and self.sharding_plan is not None:
            raise PlanFormatError(
                "plan field tensor_parallel.sharding_plan is given but mesh.tp=1 has nothing to shard; "
                "drop it (null) or raise mesh.tp"
            )
        if not isinstance(self.sequence_parallel, bool) or (self.sequence_parallel and tp == 1):
            raise PlanFormatError(
                f"plan field tensor_parallel.sequence_parallel={self.sequence_parallel!r} must be a bool, "
                "and true only with mesh.tp > 1"
            )

    def _check_expert_parallel(self) -> None:
        ep, tp = self.mesh_size("ep"), self.mesh_size("tp")
        choice = self.expert_tensor_parallel
        if not (choice is None or isinstance(choice, bool)) or (choice and tp == 1):
            raise PlanFormatError(
                f"plan field expert_parallel.expert_tensor_parallel={choice!r} must be null (the default), "
                "a bool, and true only with mesh.tp > 1 (it splits the experts over tp)"
            )
        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0
        ):
            raise PlanFormatError(
                f"plan field expert_parallel.capacity_factor must be a positive number or null (dropless), "
                f"got {factor!r}"
            )
        if factor is not None and ep == 1:
            raise PlanFormatError(
                "plan field expert_parallel.capacity_factor is given but mesh.ep=1 dispatches no token; "
                "drop it (null) or raise mesh.ep"
            )

    def _check_batches(self) -> None:
        pp, batch_ranks = self.mesh_size("pp"), self.batch_ranks
        _positive_int(self.global_batch_size, "micro_batching.global_batch_size")
        _positive_int(self.micro_batch_size, "micro_batching.micro_batch_size")
        _positive_int(self.sequence_length, "micro_batching.sequence_length")
        if self.global_batch_size % (batch_ranks * self.micro_batch_size):
            ranks = f"dp={self.mesh_size('dp')}"
            if self.mesh_size("ep") > 1:
                ranks += f" x ep={self.mesh_size('ep')}"
            raise PlanFormatError(
                f"plan field micro_batching.global_batch_size={self.global_batch_size} does not split into "
                f"{ranks} ranks x micro_batch_size={self.micro_batch_size}; make it a multiple of "
                f"{batch_ranks * self.micro_batch_size}"
            )
        if (self.pipeline is None) != (pp == 1):
            raise PlanFormatError(
                f"plan field pipeline_parallel must be given exactly when mesh.pp > 1 (mesh.pp={pp}); "
                "give a pipeline section with size = mesh.pp, or null with mesh.pp = 1"
            )
        if self.pipeline is not None and self.pipeline.size != pp:
            raise PlanFormatError(
                f"plan field pipeline_parallel.size={self.pipeline.size} differs from mesh.pp={pp}"
            )
        if self.pipeline is not None and self.pipeline.num_microbatches != self.num_microbatches:
            raise PlanFormatError(
                f"plan field pipeline_parallel.num_microbatches={self.pipeline.num_microbatches}, but "
                f"global_batch_size / (dp x ep x micro_batch_size) = {self.num_microbatches}; make them agree"
            )

    def mesh_size(self, dim: str) -> int:
        """The size of mesh dimension ``dim`` (``"pp"``, ``"dp"``, ``"ep"`` or ``"tp"``)."""
        return dict(self.mesh)[dim]

    @property
    def world_size(self) -> int:
        """The number of devices the plan runs on."""
        total = 1
        for _, size in self.mesh:
            total *= size
        return total

    @property
    def experts_split_over_tp(self) -> bool:
        """Whether the tensor-parallel plan splits the experts: ``expert_tensor_parallel``, or by
        default when they are not expert-parallel (``ep == 1``, ``tp > 1``)."""
        if self.expert_tensor_parallel is not None:
            return self.expert_tensor_parallel
        return self.mesh_size("ep") == 1 and self.mesh_size("tp") > 1

    @property
    def batch_ranks(self) -> int:
        """The ranks the global batch is split over: dp x ep."""
        return self.mesh_size("dp") * self.mesh_size("ep")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per dp x ep rank per step (gradient accumulation steps without a pipeline)."""
        return self.global_batch_size // (self.batch_ranks * self.micro_batch_size)

    @property
    def mixed_precision(self) -> str:
        """``"fp32"`` or ``"bf16"`` (kept in the data-parallel section, which applies it)."""
        return self.data_parallel.mixed_precision

    def parallel_choices(self) -> ParallelChoices:
        """The choices that decide memory, for :func:`~vescale.planner.memory.estimate_memory`."""
        return ParallelChoices(
            tensor_parallel_size=self.mesh_size("tp"),
            pipeline_parallel_size=self.mesh_size("pp"),
            data_parallel_size=self.mesh_size("dp"),
            expert_parallel_size=self.mesh_size("ep"),
            sequence_parallel=self.sequence_parallel,
            zero_stage=self.data_parallel.zero_stage,
            micro_batch_size=self.micro_batch_size,
            sequence_length=self.sequence_length,
            num_microbatches=self.num_microbatches,
            schedule=self.pipeline.schedule if self.pipeline else "1f1b",
            mixed_precision=self.mixed_precision,
            activation_checkpointing=self.activation_checkpointing,
            sharding_plan=self.sharding_plan,
        )

    def explain(self) -> str:
        """Why each choice was made, one line each; with a predicted performance, the runners-up
        with their breakdowns and why each lost.

        Example::

            print(generate_plan(model, {"hardware": "h100-80gb"}, world_size=8).explain())
        """
        width = max((len(choice) for choice, _ in self.reasons), default=0)
        lines = [f"{choice:<{width}}  {reason}" for choice, reason in self.reasons]
        if self.performance is not None and self.performance.runners_up:
            lines.append("runners-up (predicted step time; why each lost)")
            for runner_up in self.performance.runners_up:
                parts = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in runner_up.breakdown)
                lines.append(
                    f"  {runner_up.choice}: {runner_up.step_time_s:.4g} s ({runner_up.lost_because})"
                )
                lines.append(f"    {parts}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready builtins (see :meth:`to_json`)."""
        memory = {
            "memory_per_device_gb": self.memory_per_device_gb,
            "estimate": self.memory_estimate.to_dict() if self.memory_estimate else None,
        }
        return {
            "format": PLAN_FORMAT,
            "mesh": dict(self.mesh),
            "tensor_parallel": {
                "sequence_parallel": self.sequence_parallel,
                "sharding_plan": self.sharding_plan.to_dict() if self.sharding_plan else None,
            },
            "pipeline_parallel": self.pipeline.to_dict() if self.pipeline else None,
            "expert_parallel": {
                "expert_tensor_parallel": self.expert_tensor_parallel,
                "capacity_factor": self.capacity_factor,
            },
            "data_parallel": self.data_parallel.to_dict(),
            "micro_batching": {
                "global_batch_size": self.global_batch_size,
                "micro_batch_size": self.micro_batch_size,
                "sequence_length": self.sequence_length,
            },
            "activation_checkpointing": self.activation_checkpointing,
            "memory": memory,
            "performance": self.performance.to_dict() if self.performance else None,
            "reasons": dict(self.reasons),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text; :meth:`from_json` reads it back equal, edited or not.

        Example::

            Path("plan.json").write_text(plan.to_json())
        """
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, plan_dict: Any) -> Plan:
        """The plan :meth:`to_dict` wrote; a bad field raises ``PlanFormatError`` naming it.

        Example::

            Plan.from_dict(json.loads(Path("plan.json").read_text()))
        """
        return cls(**plan_fields_from_dict(plan_dict, TOP_LEVEL_KEYS))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse the JSON text of a plan (see :meth:`from_dict`).

        Example::

            plan = Plan.from_json(Path("plan.json").read_text())
        """
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFormatError(f"the plan is not valid JSON: {error}") from None
        return cls.from_dict(loaded)

    def __str__(self) -> str:
        return format_plan_table(self)
