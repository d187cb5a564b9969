"""Read exactly the bytes of saved chunks that overlap a rank's boxes, and check them.

A chunk is stored row-major, so the part of it inside a box is a set of equal runs: one run
when the box spans every dim but the first, one run per row for an inner-dim slice, and so
on. Each run is read with one ``pread`` into a buffer laid out like the overlap, which is
then copied into the local tensor. Every shard file is checked before use (size and header
CRC against the index); a chunk read whole is checked against its CRC-32.

Example::

    reader = ShardReader(checkpoint_dir, index)
    reader.read_into(index.tensors["model/fc.weight"], local_tensor, layout.local_boxes(rank))
    reader.stats.bytes_read / reader.stats.bytes_needed   # 1.0 when only needed bytes were read
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vescale.dcheckpoint.errors import CheckpointFormatError
from vescale.dcheckpoint.index import CheckpointIndex, ChunkRecord, TensorRecord
from vescale.dcheckpoint.layout import Box, LocalBox
from vescale.dcheckpoint.safetensors_format import parse_header_length

__all__ = ["SLAB_BYTES", "ReadStats", "ShardReader"]

# A region that cannot be read straight into its target goes through a buffer of at most
# this many bytes (or one row, if a row is larger).
SLAB_BYTES = 16 << 20


@dataclass
class ReadStats:
    """Bytes a rank read from tensor data, bytes its boxes hold, header bytes, read calls, and
    the bytes of its boxes that another rank read and sent it (replicated tensors)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    header_bytes: int = 0
    read_calls: int = 0
    bytes_received: int = 0


def _damaged(file: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"shard file {file!r} {problem}; it is truncated or corrupted: restore it, or load an earlier "
        "checkpoint"
    )


class ShardReader:
    """Reads byte ranges of one checkpoint's shard files; use as a context manager or :meth:`close`."""

    def __init__(self, directory: Path, index: CheckpointIndex) -> None:
        self.directory, self.index = directory.resolve(), index
        self.stats = ReadStats()
        self._descriptors: dict[str, int] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every open shard file."""
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()

    def _open(self, file: str) -> int:
        if file in self._descriptors:
            return self._descriptors[file]
        path = (self.directory / file).resolve()
        if path.parent != self.directory:
            raise CheckpointFormatError(f"the index names file {file!r}, which lies outside {self.directory}")
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise _damaged(file, "is missing") from None
        self._descriptors[file] = descriptor
        record = self.index.files[file]
        size = os.fstat(descriptor).st_size
        if size != record.size:
            raise _damaged(file, f"has {size} bytes where the index expects {record.size}")
        header_length = parse_header_length(os.pread(descriptor, 8, 0), file, size)
        prefix = os.pread(descriptor, 8 + header_length, 0)
        self.stats.header_bytes += len(prefix)
        if zlib.crc32(prefix) != record.header_crc32:
            raise _damaged(file, "has a header whose checksum does not match the index")
        return descriptor

    def _read_region(
        self,
        chunk: ChunkRecord,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        itemsize: int,
        out: memoryview,
    ) -> None:
        descriptor = self._open(chunk.file)
        chunk_sizes = chunk.box.sizes
        ndim = len(chunk_sizes)
        # Dims after `run_dim` are read whole, so each run spans them and part of dim `run_dim`.
        run_dim = ndim - 1
        while run_dim > 0 and offsets[run_dim] == 0 and sizes[run_dim] == chunk_sizes[run_dim]:
            run_dim -= 1
        strides = [1] * ndim
        for dim in range(ndim - 2, -1, -1):
            strides[dim] = strides[dim + 1] * chunk_sizes[dim + 1]
        run_bytes = itemsize * (sizes[run_dim] * strides[run_dim] if ndim else 1)
        base = chunk.byte_start + itemsize * (offsets[run_dim] * strides[run_dim] if ndim else 0)
        outer = [range(offsets[d], offsets[d] + sizes[d]) for d in range(run_dim)]
        for position, index in enumerate(itertools.product(*outer)):
            start = base + itemsize * sum(i * strides[d] for d, i in enumerate(index))
            run = out[position * run_bytes : (position + 1) * run_bytes]
            if os.preadv(descriptor, [run], start) != run_bytes:
                raise _damaged(chunk.file, f"ends before byte {start + run_bytes}")
            self.stats.read_calls += 1
        self.stats.bytes_read += len(out)

    def read_into(self, record: TensorRecord, local: torch.Tensor, local_boxes: Sequence[LocalBox]) -> None:
        """Fill ``local`` (a rank's local tensor) at ``local_boxes`` from the saved chunks of ``record``.

        Example::

            reader.read_into(index.tensors["model/fc.weight"], param.to_local(), layout.local_boxes(rank))
        """
        for local_box in local_boxes:
            self.stats.bytes_needed += local_box.box.numel * record.dtype.itemsize
            self._fill(record, local, local_box)

    def read_box(self, record: TensorRecord, box: Box, destination: torch.Tensor) -> None:
        """Read the global region ``box`` of ``record`` into ``destination`` (of shape ``box.sizes``).

        Example::

            piece = torch.empty(box.sizes, dtype=record.dtype)
            reader.read_box(record, box, piece)   # e.g. to send it to the other holders
        """
        self._fill(record, destination, LocalBox(box, (0,) * len(box.sizes)))

    def _fill(self, record: TensorRecord, local: torch.Tensor, local_box: LocalBox) -> None:
        for chunk in record.chunks:
            overlap = local_box.box.intersect(chunk.box)
            if overlap is None:
                continue
            in_chunk = tuple(o - c for o, c in zip(overlap.offsets, chunk.box.offsets, strict=True))
            starts = [
                lo + o - b
                for lo, o, b in zip(
                    local_box.local_offsets, overlap.offsets, local_box.box.offsets, strict=True
                )
            ]
            target = local[tuple(slice(s, s + n) for s, n in zip(starts, overlap.sizes, strict=True))]
            crc = self._read_into_target(chunk, in_chunk, overlap.sizes, record.dtype, target)
            if overlap == chunk.box and chunk.crc32 is not None and crc != chunk.crc32:
                raise _damaged(chunk.file, f"holds data of {record.name!r} whose checksum does not match")

    def _read_into_target(
        self,
        chunk: ChunkRecord,
        in_chunk: tuple[int, ...],
        sizes: tuple[int, ...],
        dtype: torch.dtype,
        target: torch.Tensor,
    ) -> int:
        """Read a region of ``chunk`` into ``target``; return the CRC-32 of its bytes in file order."""
        itemsize = dtype.itemsize
        if target.device.type == "cpu" and target.is_contiguous():
            # Straight into the target's memory: no copy, and no second buffer, so exporting a
            # tensor needs only its own size in memory.
            direct = target.detach().reshape(-1).view(torch.uint8).numpy()
            self._read_region(chunk, in_chunk, sizes, itemsize, direct.data)
            return zlib.crc32(direct.data)
        # Otherwise through a bounded buffer, slab by slab along the region's first dim: the slabs
        # are consecutive in the file, so the CRC carries over from one to the next.
        if not sizes:
            buffer = bytearray(itemsize)
            self._read_region(chunk, in_chunk, sizes, itemsize, memoryview(buffer))
            target.copy_(torch.frombuffer(buffer, dtype=dtype).reshape(()))
            return zlib.crc32(buffer)
        row_bytes = math.prod(sizes[1:]) * itemsize
        rows_per_slab = max(1, SLAB_BYTES // row_bytes)
        crc = 0
        for first in range(0, sizes[0], rows_per_slab):
            rows = min(rows_per_slab, sizes[0] - first)
            slab_sizes = (rows, *sizes[1:])
            buffer = bytearray(rows * row_bytes)
            self._read_region(
                chunk, (in_chunk[0] + first, *in_chunk[1:]), slab_sizes, itemsize, memoryview(buffer)
            )
            crc = zlib.crc32(buffer, crc)
            target[first : first + rows].copy_(torch.frombuffer(buffer, dtype=dtype).reshape(slab_sizes))
        return crc
