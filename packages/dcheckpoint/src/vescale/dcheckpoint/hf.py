"""Hugging Face interop: load a ``save_pretrained`` safetensors checkpoint into a (parallelized)
model, and export a checkpoint of ours as one that ``from_pretrained`` loads.

Names. A Hugging Face file names tensors by the model's ``state_dict`` keys, and so do we:
``load_hf`` matches them exactly. ``save_pretrained`` leaves out tied parameters (with
``tie_word_embeddings``, ``lm_head.weight`` is the embedding and is not in the file), so the
rule is: a model key missing from the files is fine when it is the *same parameter* as a key
the files hold (it is filled through that key); any other missing key, and any key of the
files that the model lacks, is a :class:`CheckpointMismatchError` unless ``strict=False``.
``export_hf`` writes every tensor under ``model/`` by its key, tied ones included (both
names, same values), which ``from_pretrained`` accepts.

Example::

    load_hf(tp_model, "hf-model")                       # each rank reads only its byte ranges
    export_hf("ckpt", "hf-export")                      # then copy config.json beside it
    AutoModelForCausalLM.from_pretrained("hf-export")
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from vescale.dcheckpoint import atomic
from vescale.dcheckpoint._gc import gc_paused
from vescale.dcheckpoint.api import LoadResult, read_index, read_targets
from vescale.dcheckpoint.async_save import wait_for_pending_save
from vescale.dcheckpoint.errors import CheckpointMismatchError, CheckpointUsageError
from vescale.dcheckpoint.hf_format import HF_INDEX_NAME, HF_SINGLE_NAME, read_hf_index
from vescale.dcheckpoint.hf_keys import (
    check_on_every_rank,
    declared_ties,
    match_keys,
    quoted_names,
    tensor_aliases,
)
from vescale.dcheckpoint.index import CheckpointIndex
from vescale.dcheckpoint.layout import Box
from vescale.dcheckpoint.reader import ShardReader
from vescale.dcheckpoint.safetensors_format import build_header

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "export_hf", "load_hf"]

# save_pretrained's default max_shard_size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def load_hf(model: nn.Module, hf_dir: str | os.PathLike[str], *, strict: bool = True) -> LoadResult:
    """Load a Hugging Face safetensors checkpoint into ``model`` in place; every rank calls it.

    ``model`` may hold DTensor parameters in any layout (tensor parallel, ZeRO-3) or only its
    pipeline stages' parameters: each rank reads only the byte ranges of its shards, and
    replicated parameters are read once and sent. Keys are checked over all ranks together
    (see :mod:`hf_keys`), so a pipeline stage needs no ``strict=False``. A file dtype other
    than the parameter's is converted (as ``from_pretrained`` does).

    Example::

        model = build_tp_model()                  # DTensor parameters
        load_hf(model, "hf-model")                # single model.safetensors or sharded with its index
        load_hf(model, "hf-model", strict=False)  # tolerate keys on one side only
    """
    wait_for_pending_save()
    directory = Path(hf_dir)
    with gc_paused():
        index = read_hf_index(directory)
        live = model.state_dict()
        shapes = {name: record.shape for name, record in index.tensors.items()}
        match = match_keys(live, tensor_aliases(model), declared_ties(model), shapes)
        check_on_every_rank(match, set(index.tensors), str(directory), strict=strict)
        # Each target reads its source's record; a tied key whose source is on another stage
        # reads the source's bytes under its own name.
        view = replace(index, tensors={name: index.tensors[source] for name, source in match.sources.items()})
        targets, conversions = {}, []
        for name in match.sources:
            record, tensor = view.tensors[name], live[name]
            if record.dtype == tensor.dtype:
                targets[name] = tensor
            else:
                # Read in the file's dtype (the reader only moves bytes), then convert in place.
                converted = tensor.detach().to(record.dtype)
                targets[name] = converted
                conversions.append((tensor, converted))
        stats = read_targets(directory, view, targets)
        with torch.no_grad():
            for tensor, converted in conversions:
                tensor.copy_(converted)
    return LoadResult(directory, stats)


def _plan_shards(names: list[str], sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    total = 0
    for name in names:
        if shards[-1] and total + sizes[name] > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += sizes[name]
    return shards


def export_hf(
    checkpoint_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    prefix: str = "model",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write the ``prefix/`` tensors of a checkpoint as a consolidated Hugging Face checkpoint.

    Runs in one process (no process group needed). Tensors are streamed one at a time, each
    read straight into one full-size buffer, so memory peaks at the largest tensor plus a
    16 MiB read buffer. Files larger than ``max_shard_bytes`` are split, with a
    ``model.safetensors.index.json``, as ``save_pretrained`` does. Only weights are written:
    put the model's ``config.json`` beside them.

    Example::

        export_hf("ckpt", "hf-export")            # ckpt/latest, or a checkpoint directory
        model.config.save_pretrained("hf-export")
        AutoModelForCausalLM.from_pretrained("hf-export")
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise CheckpointUsageError(f"max_shard_bytes={max_shard_bytes!r}: pass a positive number of bytes")
    directory = atomic.resolve_checkpoint(Path(checkpoint_path))
    out = Path(out_dir)
    with gc_paused():
        index = read_index(directory)
        names = sorted(name for name in index.tensors if name.startswith(f"{prefix}/"))
        if not names:
            raise CheckpointMismatchError(
                f"{str(directory)!r} holds no tensors under {prefix!r}/ (it has "
                f"{quoted_names(set(index.tensors))}); pass the state key the model was saved under "
                "as prefix="
            )
        sizes = {
            name: Box((0,) * len(index.tensors[name].shape), index.tensors[name].shape).numel
            for name in names
        }
        sizes = {name: count * index.tensors[name].dtype.itemsize for name, count in sizes.items()}
        shards = _plan_shards(names, sizes, max_shard_bytes)
        out.mkdir(parents=True, exist_ok=True)
        file_names = (
            [HF_SINGLE_NAME]
            if len(shards) == 1
            else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        )
        written = []
        with ShardReader(directory, index) as reader:
            for file_name, shard in zip(file_names, shards, strict=True):
                written.append(_write_hf_file(out / file_name, shard, index, reader, prefix))
        if len(shards) > 1:
            weight_map = {
                name[len(prefix) + 1 :]: file_name
                for file_name, shard in zip(file_names, shards, strict=True)
                for name in shard
            }
            body = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            written.append(_write_atomically(out / HF_INDEX_NAME, json.dumps(body, indent=2).encode()))
    return written


def _write_atomically(path: Path, content: bytes) -> Path:
    pending = path.with_name(f".{path.name}.saving")
    pending.write_bytes(content)
    atomic.fsync_file(pending)
    os.replace(pending, path)
    return path


def _write_hf_file(
    path: Path, shard: list[str], index: CheckpointIndex, reader: ShardReader, prefix: str
) -> Path:
    records = [index.tensors[name] for name in shard]
    header = build_header(
        {name[len(prefix) + 1 :]: (r.dtype, r.shape) for name, r in zip(shard, records, strict=True)},
        metadata={"format": "pt"},  # transformers refuses safetensors files without it
    )
    pending = path.with_name(f".{path.name}.saving")
    with open(pending, "wb") as file:
        file.write(len(header.header_bytes).to_bytes(8, "little") + header.header_bytes)
        for record in records:
            full = torch.empty(record.shape, dtype=record.dtype)
            reader.read_box(record, Box((0,) * len(record.shape), record.shape), full)
            file.write(full.reshape(-1).view(torch.uint8).numpy().data)
            del full  # before the next tensor's buffer: one tensor in memory at a time
        file.flush()
        os.fsync(file.fileno())
    os.replace(pending, path)
    return path
