"""A Hugging Face safetensors checkpoint read as a checkpoint index: every tensor one chunk.

Hugging Face writes ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files
named by ``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``). Each file's
header says where each tensor's bytes are, so the files become a :class:`CheckpointIndex`
whose tensors each have one chunk (the whole tensor, no CRC: the format has none), and the
same reader that loads our checkpoints reads any rank's byte ranges out of them.

Example::

    index = read_hf_index(Path("hf-model"))
    index.tensors["model.embed_tokens.weight"].shape
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from vescale.dcheckpoint.errors import CheckpointFormatError, CheckpointNotFoundError
from vescale.dcheckpoint.index import CheckpointIndex, ChunkRecord, FileRecord, TensorRecord
from vescale.dcheckpoint.layout import Box
from vescale.dcheckpoint.safetensors_format import SAFETENSORS_DTYPE, parse_header_length

__all__ = ["HF_INDEX_NAME", "HF_SINGLE_NAME", "read_hf_index"]

HF_SINGLE_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
_DTYPE_BY_SAFETENSORS = {code: dtype for dtype, code in SAFETENSORS_DTYPE.items()}
_MAX_HF_INDEX_BYTES = 64 << 20


def _hf_fail(file: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"Hugging Face file {file!r} {problem}; it is truncated or not a safetensors checkpoint"
    )


def _shard_files(hf_dir: Path) -> list[str]:
    index_path = hf_dir / HF_INDEX_NAME
    if index_path.is_file():
        if index_path.stat().st_size > _MAX_HF_INDEX_BYTES:
            raise _hf_fail(HF_INDEX_NAME, f"is larger than {_MAX_HF_INDEX_BYTES} bytes")
        try:
            weight_map = json.loads(index_path.read_bytes())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise _hf_fail(HF_INDEX_NAME, 'is not JSON with a "weight_map"') from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise _hf_fail(HF_INDEX_NAME, "has a weight_map that is not {tensor name: file name}")
        files = sorted(set(weight_map.values()))
        for file in files:
            if Path(file).name != file or not file.endswith(".safetensors"):
                raise _hf_fail(HF_INDEX_NAME, f"names {file!r}, which is not a .safetensors file beside it")
        return files
    if (hf_dir / HF_SINGLE_NAME).is_file():
        return [HF_SINGLE_NAME]
    raise CheckpointNotFoundError(
        f"{str(hf_dir)!r} holds neither {HF_SINGLE_NAME} nor {HF_INDEX_NAME}; pass the directory "
        "save_pretrained wrote (safetensors only: .bin files are pickle and are not read)"
    )


def _file_tensors(
    hf_dir: Path, file: str
) -> tuple[FileRecord, list[tuple[str, Any, tuple[int, ...], int, int]]]:
    path = hf_dir / file
    if not path.is_file():
        raise _hf_fail(file, "is missing")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        length_bytes = handle.read(8)
        header_length = parse_header_length(length_bytes, file, size)
        header_bytes = handle.read(header_length)
    try:
        header = json.loads(header_bytes)
    except ValueError:
        raise _hf_fail(file, "has a header that is not JSON") from None
    if not isinstance(header, dict):
        raise _hf_fail(file, "has a header that is not a JSON object")
    data_start = 8 + header_length
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPE_BY_SAFETENSORS[entry["dtype"]]
            shape = tuple(int(size) for size in entry["shape"])
            start, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _hf_fail(file, f"describes {name!r} with an unknown dtype or malformed fields") from None
        numel = Box((0,) * len(shape), shape).numel
        if min(shape, default=0) < 0 or end - start != numel * dtype.itemsize or data_start + end > size:
            raise _hf_fail(
                file, f"places {name!r} at bytes [{start}, {end}), which do not hold {shape} {dtype}"
            )
        entries.append((name, dtype, shape, data_start + start, data_start + end))
    # The reader checks each file's header against this CRC: the file cannot change unnoticed
    # between this parse and the reads.
    return FileRecord(size, zlib.crc32(length_bytes + header_bytes)), entries


def read_hf_index(hf_dir: Path) -> CheckpointIndex:
    """The index of a Hugging Face safetensors checkpoint directory (single file or sharded).

    Example::

        index = read_hf_index(Path("hf-model"))
        sorted(index.tensors)[:2]   # ["lm_head.weight", "model.embed_tokens.weight"]
    """
    files: dict[str, FileRecord] = {}
    tensors: dict[str, TensorRecord] = {}
    for file in _shard_files(hf_dir):
        files[file], entries = _file_tensors(hf_dir, file)
        for name, dtype, shape, start, end in entries:
            if name in tensors:
                raise _hf_fail(file, f"holds {name!r}, which another file holds too")
            chunk = ChunkRecord(Box((0,) * len(shape), shape), file, name, start, end, None)
            tensors[name] = TensorRecord(name, shape, dtype, (1,), ("R",), (chunk,))
    return CheckpointIndex(1, os.stat(hf_dir).st_mtime_ns, files, tensors, {}, None)
