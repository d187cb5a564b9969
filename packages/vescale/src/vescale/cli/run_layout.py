"""How a ``vescale train`` run cut its global batches and summed its gradients, as rank 0 records it.

The single-device reference of ``--compare-single-device`` reads it back to repeat the parallel
run's arithmetic: the same pieces of each global batch (one per data-parallel rank, each cut into
the rank's micro-batches), backward in the same order, the same thread count per process.

Example::

    layout = RunLayout.of_plan(plan, threads_per_rank=1)
    RunLayout.from_dict(layout.to_dict()) == layout
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["RunLayout"]


@dataclass(frozen=True)
class RunLayout:
    """The plan's batch and mesh numbers that fix a run's arithmetic, and the threads per rank.

    ``micro_batches_per_rank``: the micro-batches one data-parallel rank accumulates per step.
    ``deterministic``: gradients were summed over the data-parallel ranks in rank order.
    ``device_type``: where the ranks computed (the reference runs on the CPU).
    """

    global_batch_size: int
    sequence_length: int
    data_parallel: int = 1
    micro_batches_per_rank: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    threads_per_rank: int = 1
    deterministic: bool = False
    device_type: str = "cpu"

    @classmethod
    def of_plan(cls, plan: Any, threads_per_rank: int, device_type: str = "cpu") -> RunLayout:
        """The layout of a run of ``plan`` (a ``vescale.Plan``) with ``threads_per_rank`` CPU threads.

        Example::

            RunLayout.of_plan(plan, threads_per_rank=torch.get_num_threads(), device_type="cpu")
        """
        return cls(
            global_batch_size=plan.global_batch_size,
            sequence_length=plan.sequence_length,
            data_parallel=plan.mesh_size("dp"),
            micro_batches_per_rank=plan.num_microbatches,
            tensor_parallel=plan.mesh_size("tp"),
            pipeline_parallel=plan.mesh_size("pp"),
            threads_per_rank=threads_per_rank,
            deterministic=plan.data_parallel.deterministic,
            device_type=device_type,
        )

    @property
    def reproducible_bitwise(self) -> bool:
        """Whether one CPU process can repeat the run's sums exactly: rank-ordered dp sums, CPU ranks.

        Tensor parallelism splits a matmul's inner sums over ranks and adds the partial results;
        a pipeline runs its own micro-batch schedule: neither is the order of one process's sums.
        GPU kernels sum in other orders than CPU ones.
        """
        return (
            self.deterministic
            and self.tensor_parallel == 1
            and self.pipeline_parallel == 1
            and self.device_type == "cpu"
        )

    def to_dict(self) -> dict[str, Any]:
        """The layout as JSON-able fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> RunLayout:
        """The layout :meth:`to_dict` wrote."""
        return cls(**fields)
