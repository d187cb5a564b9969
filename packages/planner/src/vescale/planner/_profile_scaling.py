"""A model profile at another micro-batch size, without running the model again.

Every activation and every op of a decoder is proportional to the samples in the micro-batch
(the batch dimension), so the search profiles one sample and scales. Batch-independent
tensors (rotary tables, masks built per sequence) are scaled too: a small overestimate.

Example::

    four = scaled_profile(profile_model(model, 2048, 1), micro_batch_size=4)
"""

from __future__ import annotations

import dataclasses

from vescale.planner.profile import ModelProfile, _SavedRecord

__all__ = ["scaled_profile"]


def scaled_profile(profile: ModelProfile, micro_batch_size: int) -> ModelProfile:
    """``profile`` as if taken at ``micro_batch_size`` (module docstring).

    Example::

        scaled_profile(profile, 2).block_input_bytes == 2 * profile.block_input_bytes
    """
    if micro_batch_size == profile.micro_batch_size:
        return profile
    factor = micro_batch_size / profile.micro_batch_size

    def records(saved: tuple[_SavedRecord, ...]) -> tuple[_SavedRecord, ...]:
        return tuple(dataclasses.replace(r, nbytes=int(r.nbytes * factor)) for r in saved)

    costs = tuple(
        dataclasses.replace(
            op,
            flops=op.flops * factor,
            traffic_bytes=op.traffic_bytes * factor,
            output_bytes=op.output_bytes * factor,
            dims=(int(op.dims[0] * factor), *op.dims[1:]) if op.kind == "matmul" else op.dims,
        )
        for op in profile.op_costs
    )
    return dataclasses.replace(
        profile,
        micro_batch_size=micro_batch_size,
        saved=records(profile.saved),
        selective_kept=records(profile.selective_kept),
        block_input_bytes=int(profile.block_input_bytes * factor),
        op_costs=costs,
    )
