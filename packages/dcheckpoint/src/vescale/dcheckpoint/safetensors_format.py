"""The safetensors container, written and parsed here so that byte offsets are known exactly.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets"}`` (offsets relative to the data section),
then the raw row-major tensor bytes. Writing it directly lets every rank stream its chunks
without building the file in memory, and lets readers slice byte ranges out of it.

Example::

    header = build_header({"w@0,0": (torch.float32, (2, 3))})
    data_start = 8 + len(header.header_bytes)            # where chunk bytes begin
    header.data_offsets["w@0,0"]                          # (0, 24)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vescale.dcheckpoint.errors import CheckpointFormatError

__all__ = [
    "DTYPE_BY_NAME",
    "SAFETENSORS_DTYPE",
    "FileHeader",
    "build_header",
    "dtype_from_name",
    "dtype_name",
    "parse_header_length",
]

# Header lengths above this are refused before anything is allocated for them.
MAX_HEADER_BYTES = 100 * 1024 * 1024

SAFETENSORS_DTYPE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype for dtype in SAFETENSORS_DTYPE
}


def dtype_name(dtype: torch.dtype) -> str:
    """The index's name of a dtype (``"float32"``), or an error for dtypes safetensors cannot hold."""
    if dtype not in SAFETENSORS_DTYPE:
        raise CheckpointFormatError(
            f"cannot save tensors of dtype {dtype}: safetensors holds only "
            f"{', '.join(sorted(DTYPE_BY_NAME))}; convert the tensor before saving"
        )
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object, where: str) -> torch.dtype:
    """The dtype an index names, or ``CheckpointFormatError`` naming ``where`` it came from."""
    if not isinstance(name, str) or name not in DTYPE_BY_NAME:
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r}; the index is damaged or not ours")
    return DTYPE_BY_NAME[name]


@dataclass(frozen=True)
class FileHeader:
    """A shard file's header bytes (padded to 8 bytes) and each entry's data byte range."""

    header_bytes: bytes
    data_offsets: dict[str, tuple[int, int]]

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data section."""
        return 8 + len(self.header_bytes)

    @property
    def file_size(self) -> int:
        """Size of the whole file once every entry's bytes are written."""
        ends = [end for _, end in self.data_offsets.values()]
        return self.data_start + max(ends, default=0)


def build_header(
    entries: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> FileHeader:
    """Lay out ``{name: (dtype, shape)}`` back to back, in the given order; ``metadata`` goes into
    the header's ``__metadata__`` (by default it names this format).

    Example::

        header = build_header({"a": (torch.float32, (4,)), "b": (torch.int64, ())})
        header.data_offsets == {"a": (0, 16), "b": (16, 24)}
    """
    header_json: dict[str, object] = {
        "__metadata__": dict(metadata) if metadata is not None else {"format": "vescale-dcheckpoint"}
    }
    data_offsets = {}
    position = 0
    for name, (dtype, shape) in entries.items():
        numel = 1
        for size in shape:
            numel *= size
        end = position + numel * dtype.itemsize
        data_offsets[name] = (position, end)
        header_json[name] = {
            "dtype": SAFETENSORS_DTYPE[dtype],
            "shape": list(shape),
            "data_offsets": [position, end],
        }
        position = end
    header_bytes = json.dumps(header_json, separators=(",", ":")).encode()
    # safetensors aligns the data section to 8 bytes by padding the header with spaces.
    header_bytes += b" " * (-len(header_bytes) % 8)
    return FileHeader(header_bytes, data_offsets)


def parse_header_length(prefix: bytes, file_name: str, file_size: int) -> int:
    """The header length a file's first 8 bytes declare, checked against the file size."""
    if len(prefix) < 8:
        raise CheckpointFormatError(
            f"shard file {file_name!r} is truncated ({file_size} bytes, less than the 8-byte header "
            "length); the save that wrote it did not finish: load an earlier checkpoint"
        )
    header_length: int
    (header_length,) = struct.unpack("<Q", prefix[:8])
    if header_length > min(MAX_HEADER_BYTES, file_size - 8):
        raise CheckpointFormatError(
            f"shard file {file_name!r} declares a {header_length}-byte header but has {file_size} bytes; "
            "the file is truncated or damaged: load an earlier checkpoint"
        )
    return header_length
