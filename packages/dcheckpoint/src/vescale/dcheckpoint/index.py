"""The checkpoint index: one JSON file that says where every byte of every tensor is.

Per tensor: global shape, dtype, the layout it was saved from (mesh shape, placements) and
its chunks (global box, file, byte range, CRC-32). Per file: size and the CRC-32 of its
header. Plus the JSON state of everything that is not a tensor and every rank's random-number
states. The file starts with ``{"checksum":<CRC-32 of every byte after it>,``, so any edit or
bit flip is detected without re-encoding the JSON; every field is
type- and range-checked on load, so a forged index can name nothing outside the checkpoint
directory and no byte outside a shard file's data section.

Example::

    raw = encode_index(body)                       # bytes rank 0 writes last
    index = parse_index(raw, "ckpt/step-100/index.json")
    index.tensors["model/fc.weight"].chunks[0].file
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from vescale.dcheckpoint.errors import CheckpointFormatError
from vescale.dcheckpoint.layout import Box
from vescale.dcheckpoint.safetensors_format import dtype_from_name

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "CheckpointIndex",
    "ChunkRecord",
    "FileRecord",
    "TensorRecord",
    "chunk_key",
    "encode_index",
    "parse_index",
    "shard_file_name",
]

FORMAT_NAME = "vescale-dcheckpoint"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors$")


def chunk_key(name: str, box: Box) -> str:
    """The entry name of a chunk in its safetensors file: ``"model/fc.weight@0,16"``."""
    return f"{name}@{','.join(str(offset) for offset in box.offsets)}"


def shard_file_name(rank: int, world_size: int) -> str:
    """The shard file rank ``rank`` writes, e.g. ``shard-00001-of-00004.safetensors``."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


@dataclass(frozen=True)
class ChunkRecord:
    """A saved box of a tensor: its bytes are ``[byte_start, byte_end)`` of ``file``, row-major.

    ``crc32`` is ``None`` only for files that carry no checksums (a Hugging Face checkpoint).

    ``key`` names the same bytes in the file's safetensors header (derived, not stored).
    """

    box: Box
    file: str
    key: str
    byte_start: int
    byte_end: int
    crc32: int | None


@dataclass(frozen=True)
class TensorRecord:
    """A saved tensor: global shape, dtype, the layout it was saved from, and its chunks."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]
    chunks: tuple[ChunkRecord, ...]


@dataclass(frozen=True)
class FileRecord:
    """A shard file's expected size and the CRC-32 of its header bytes."""

    size: int
    header_crc32: int


@dataclass(frozen=True)
class CheckpointIndex:
    """A parsed, validated index."""

    world_size: int
    created_ns: int
    files: dict[str, FileRecord]
    tensors: dict[str, TensorRecord]
    objects: dict[str, Any]
    rng: list[Any] | None


_CHECKSUM_PREFIX = re.compile(rb'^\{"checksum":(\d{1,10}),')


def encode_index(body: dict[str, Any]) -> bytes:
    """The index file's bytes: ``body`` with its format, version and content checksum added.

    Example::

        body = {"world_size": 1, "created_ns": 0, "files": [], "tensors": {}, "objects": {}, "rng": None}
        raw = encode_index(body)
        parse_index(raw, "index.json").world_size   # 1
    """
    content = json.dumps(
        {**body, "format": FORMAT_NAME, "version": FORMAT_VERSION}, separators=(",", ":")
    ).encode()
    # The content's own opening brace is replaced by the checksum member, keeping one JSON object.
    rest = content[1:]
    return b'{"checksum":%d,' % zlib.crc32(rest) + rest


def _fail(where: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where}: {problem}; the index is damaged or was not written by vescale")


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _fail(where, f"expected a non-negative integer, got {value!r}")
    return value


def _ints(value: Any, where: str, length: int | None = None) -> tuple[int, ...]:
    # The common, valid case first: an index holds tens of thousands of these lists.
    if (
        type(value) is list
        and (length is None or len(value) == length)
        and all(type(item) is int and item >= 0 for item in value)
    ):
        return tuple(value)
    if not isinstance(value, list) or (length is not None and len(value) != length):
        raise _fail(where, f"expected a list of {length if length is not None else 'some'} integers")
    return tuple(_int(item, where) for item in value)


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected a mapping, got {type(value).__name__}")
    return value


def _parse_chunk(
    raw: Any, record: TensorRecord, files: dict[str, FileRecord], file_names: list[str], where: str
) -> ChunkRecord:
    raw = _dict(raw, where)
    ndim = len(record.shape)
    box = Box(
        _ints(raw.get("offsets"), f"{where} offsets", ndim), _ints(raw.get("sizes"), f"{where} sizes", ndim)
    )
    if any(o + s > limit for o, s, limit in zip(box.offsets, box.sizes, record.shape, strict=True)):
        raise _fail(where, f"box {box} lies outside the tensor's shape {record.shape}")
    file_number = _int(raw.get("file"), f"{where} file")
    if file_number >= len(file_names):
        raise _fail(where, f"file number {file_number} is not one of the index's {len(file_names)} files")
    file = file_names[file_number]
    start, end = _ints(raw.get("byte_range"), f"{where} byte_range", 2)
    if end - start != box.numel * record.dtype.itemsize or end > files[file].size:
        raise _fail(
            where, f"byte range [{start}, {end}) does not hold {box.sizes} {record.dtype} in {file!r}"
        )
    crc32 = _int(raw.get("crc32"), f"{where} crc32")
    return ChunkRecord(box, file, chunk_key(record.name, box), start, end, crc32)


def _parse_tensor(name: str, raw: Any, files: dict[str, FileRecord], file_names: list[str]) -> TensorRecord:
    where = f"tensor {name!r}"
    raw = _dict(raw, where)
    shape = _ints(raw.get("shape"), f"{where} shape")
    mesh_shape = _ints(raw.get("mesh_shape"), f"{where} mesh_shape")
    placements = raw.get("placements")
    if not isinstance(placements, list) or not all(isinstance(p, str) for p in placements):
        raise _fail(where, "placements must be a list of strings")
    record = TensorRecord(
        name, shape, dtype_from_name(raw.get("dtype"), where), mesh_shape, tuple(placements), ()
    )
    chunk_list = raw.get("chunks")
    if not isinstance(chunk_list, list):
        raise _fail(where, "chunks must be a list")
    chunks = tuple(
        _parse_chunk(chunk, record, files, file_names, f"{where} chunk {i}")
        for i, chunk in enumerate(chunk_list)
    )
    numel = Box((0,) * len(shape), shape).numel
    overlapping = any(a.box.intersect(b.box) for i, a in enumerate(chunks) for b in chunks[i + 1 :])
    if overlapping or sum(chunk.box.numel for chunk in chunks) != numel:
        raise _fail(where, f"its chunks do not tile the shape {shape} exactly")
    return TensorRecord(name, shape, record.dtype, mesh_shape, tuple(placements), chunks)


def parse_index(raw: bytes, where: str) -> CheckpointIndex:
    """Parse and validate an index file's bytes; ``where`` names it in errors.

    Example::

        index = parse_index(Path("ckpt/step-100/index.json").read_bytes(), "ckpt/step-100/index.json")
        index.tensors["model/fc.weight"].shape
    """
    checksum = _CHECKSUM_PREFIX.match(raw)
    if checksum is None:
        raise _fail(where, "it does not start with its checksum")
    if int(checksum.group(1)) != zlib.crc32(raw[checksum.end() :]):
        raise _fail(where, "its content checksum does not match (edited or corrupted)")
    try:
        body = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _fail(where, f"not JSON ({type(error).__name__})") from None
    body = _dict(body, where)
    if body.get("format") != FORMAT_NAME or body.get("version") != FORMAT_VERSION:
        raise _fail(
            where, f"format {body.get('format')!r} version {body.get('version')!r} is not {FORMAT_NAME} v1"
        )
    file_list = body.get("files")
    if not isinstance(file_list, list):
        raise _fail(where, "files must be a list")
    files: dict[str, FileRecord] = {}
    for number, entry in enumerate(file_list):
        name = _dict(entry, f"{where} file {number}").get("name")
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name in files:
            raise _fail(where, f"file name {name!r} is not a plain shard file name inside the checkpoint")
        files[name] = FileRecord(
            _int(entry.get("size"), f"file {name!r} size"),
            _int(entry.get("header_crc32"), f"file {name!r} crc32"),
        )
    file_names = list(files)
    tensors = {
        name: _parse_tensor(name, entry, files, file_names)
        for name, entry in _dict(body.get("tensors"), where).items()
    }
    rng = body.get("rng")
    if rng is not None and not isinstance(rng, list):
        raise _fail(where, "rng must be a list of per-rank states")
    return CheckpointIndex(
        _int(body.get("world_size"), f"{where} world_size"),
        _int(body.get("created_ns"), f"{where} created_ns"),
        files,
        tensors,
        _dict(body.get("objects"), f"{where} objects"),
        rng,
    )
