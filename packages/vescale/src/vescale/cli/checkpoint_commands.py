"""``vescale checkpoint inspect`` and ``vescale checkpoint export-hf``: read a checkpoint without ranks.

``inspect`` reads only the index (no tensor data): every tensor's global shape, dtype, the
layout it was saved from (mesh shape and placements), its size, the non-tensor state and the
plan the run was saved with. ``export-hf`` writes the model's tensors as a Hugging Face
safetensors checkpoint (``vescale.dcheckpoint.export_hf``), with the run's ``config.json`` and
tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ...) copied beside it.

Example::

    vescale checkpoint inspect vescale_checkpoints/tiny-llama
    vescale checkpoint export-hf vescale_checkpoints/tiny-llama hf-out
"""

from __future__ import annotations

import datetime
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vescale.cli.errors import CLIUsageError
from vescale.cli.text_corpus import TOKENIZER_FILES

__all__ = ["checkpoint_directory", "export_hf_command", "find_saved_plan", "inspect_command"]

_INDEX_NAME = "index.json"
_LATEST_NAME = "latest"
_PLAN_FORMAT = "vescale.plan/1"


def checkpoint_directory(path: Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or the one its ``latest`` pointer names.

    Example::

        checkpoint_directory(Path("vescale_checkpoints/tiny-llama"))   # .../step-000200
    """
    if (path / _INDEX_NAME).is_file():
        return path
    pointer = path / _LATEST_NAME
    if pointer.is_file():
        named = path / pointer.read_text().strip()
        if (named / _INDEX_NAME).is_file():
            return named
    raise CLIUsageError(
        f"no checkpoint at {str(path)!r}: it holds neither {_INDEX_NAME} nor a {_LATEST_NAME!r} pointer; "
        "pass a directory `vescale train` saved into (--checkpoint-dir) or one of its step-* directories"
    )


def _plan_candidates(value: Any) -> Iterator[Any]:
    if isinstance(value, str) and _PLAN_FORMAT in value:
        try:
            yield from _plan_candidates(json.loads(value))
        except json.JSONDecodeError:
            return
    elif isinstance(value, dict):
        if value.get("format") == _PLAN_FORMAT:
            yield value
        else:
            for item in value.values():
                yield from _plan_candidates(item)
    elif isinstance(value, list):
        for item in value:
            yield from _plan_candidates(item)


def find_saved_plan(objects: dict[str, Any]) -> Any:
    """The ``vescale.Plan`` kept in a checkpoint's non-tensor state, or ``None`` when it holds none.

    Example::

        plan = find_saved_plan(read_index(directory).objects)
    """
    from vescale.planner import Plan

    for candidate in _plan_candidates(objects):
        return Plan.from_dict(candidate)
    return None


def _human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def inspect_command(path: Path, console: Console) -> None:
    """Print the tensors, layouts, sizes, non-tensor state and saved plan of the checkpoint at ``path``.

    Example::

        inspect_command(Path("vescale_checkpoints/tiny-llama"), Console())
    """
    from vescale.dcheckpoint import read_index

    directory = checkpoint_directory(path)
    index = read_index(directory)
    created = datetime.datetime.fromtimestamp(index.created_ns / 1e9).isoformat(timespec="seconds")
    stored = sum(record.size for record in index.files.values())
    console.print(f"checkpoint {directory}")
    console.print(
        f"saved by {index.world_size} rank{'s' if index.world_size > 1 else ''} at {created}; "
        f"{len(index.files)} shard files, "
        f"{_human_bytes(stored)}; {len(index.tensors)} tensors"
    )
    table = Table(title="tensors", title_justify="left")
    for column in ("name", "global shape", "dtype", "saved mesh", "placements", "size", "chunks"):
        table.add_column(column, justify="right" if column in ("size", "chunks") else "left")
    for name in sorted(index.tensors):
        record = index.tensors[name]
        size = math.prod(record.shape) * record.dtype.itemsize
        table.add_row(
            name,
            "x".join(map(str, record.shape)) or "scalar",
            str(record.dtype).removeprefix("torch."),
            "x".join(map(str, record.mesh_shape)) or "-",
            ", ".join(record.placements) or "-",
            _human_bytes(size),
            str(len(record.chunks)),
        )
    console.print(table)
    console.print(f"non-tensor state: {', '.join(sorted(index.objects)) or 'none'}")
    plan = find_saved_plan(index.objects)
    if plan is None:
        console.print("saved plan: none")
    else:
        console.print("saved plan:")
        console.print(str(plan), markup=False, highlight=False)


def export_hf_command(path: Path, out: Path, prefix: str, console: Console) -> None:
    """Write the ``prefix/`` tensors of the checkpoint at ``path`` to ``out`` as Hugging Face safetensors.

    Example::

        export_hf_command(Path("vescale_checkpoints/tiny-llama"), Path("hf-out"), "model", Console())
    """
    from vescale.dcheckpoint import export_hf

    directory = checkpoint_directory(path)
    written = export_hf(directory, out, prefix=prefix)
    total = sum(file.stat().st_size for file in written)
    console.print(
        f"exported {directory} to {out}: {', '.join(file.name for file in written)} ({_human_bytes(total)})"
    )
    config = directory.parent / "config.json"
    if config.is_file() and not (out / "config.json").exists():
        (out / "config.json").write_text(config.read_text())
        console.print(f"copied {config} beside it: transformers' from_pretrained({str(out)!r}) loads it")
    elif not (out / "config.json").exists():
        console.print("add the model's config.json beside the weights for transformers' from_pretrained")
    copied = [
        name
        for name in TOKENIZER_FILES
        if (directory.parent / name).is_file() and not (out / name).exists()
        if shutil.copyfile(directory.parent / name, out / name)
    ]
    if copied:
        console.print(
            f"copied the tokenizer files {', '.join(copied)}: AutoTokenizer.from_pretrained loads them"
        )
