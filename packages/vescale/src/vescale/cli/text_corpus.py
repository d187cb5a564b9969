"""``--data`` and ``--tokenizer``: documents read from text, JSONL, Parquet or a ``datasets`` directory,
tokenized once (cached beside the data), packed with EOS separators into fixed-length samples.

Without a tokenizer the text stays byte-level (vocabulary 256), the default run's form. With a
Hugging Face ``tokenizers`` file (``--tokenizer PATH``, or ``tokenizer.json`` in the ``--model``
directory) every document is encoded, an EOS token appended, and the documents' tokens
concatenated; the stream is cut into consecutive samples as :class:`~vescale.cli.data.ByteTextDataset`
cuts bytes. The token ids are cached in ``.vescale-cache/`` beside the data under a key of the
tokenizer's and the data's SHA-256 and the text field, so the launcher tokenizes once and every
rank (and every restart) reads the cache.

Example::

    tokens = corpus_tokens(CorpusSource("corpus.jsonl", "tok/tokenizer.json", "text"), eos_token_id=2)
    dataset = TokenDataset(tokens, sequence_length=128, seed=0)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from vescale.cli.errors import CLIUsageError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
"""Files ``from_pretrained`` reads beside a tokenizer; a run keeps them, export-hf copies them."""

__all__ = [
    "TOKENIZER_FILES",
    "CorpusSource",
    "copy_tokenizer_files",
    "corpus_tokens",
    "encode_documents",
    "read_documents",
    "tokenizer_file",
    "tokenizer_vocabulary",
]

_CACHE_DIR = ".vescale-cache"
_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")


@dataclass(frozen=True)
class CorpusSource:
    """The data file (or ``datasets`` directory), the tokenizer file (``None``: bytes), the JSON field."""

    data: str
    tokenizer: str | None = None
    text_field: str = "text"


def tokenizer_file(tokenizer: str | None, model: str) -> str | None:
    """The ``tokenizer.json`` to use: ``--tokenizer`` (a file or a directory), else the model directory's.

    Example::

        tokenizer_file(None, "my-llama")   # 'my-llama/tokenizer.json' when it exists, else None
    """
    if tokenizer is not None:
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise CLIUsageError(
                f"--tokenizer {tokenizer!r}: no tokenizer.json there; pass a Hugging Face tokenizers file"
            )
        return str(path)
    beside_model = Path(model) / "tokenizer.json"
    return str(beside_model) if Path(model).is_dir() and beside_model.is_file() else None


def _json_documents(path: Path, text_field: str) -> list[str]:
    documents = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CLIUsageError(f"--data {str(path)!r} line {number} is not JSON ({error}); fix it") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise CLIUsageError(
                f"--data {str(path)!r} line {number} has no string field {text_field!r}; "
                "name the text's field with --text-field"
            )
        documents.append(record[text_field])
    return documents


def _column(table_columns: list[str], text_field: str, where: str) -> None:
    if text_field not in table_columns:
        raise CLIUsageError(
            f"--data {where!r} has no column {text_field!r} (it has {', '.join(table_columns)}); "
            "name the text's column with --text-field"
        )


def _parquet_documents(path: Path, text_field: str) -> list[str]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise CLIUsageError(
            f"--data {str(path)!r} is Parquet, which needs pyarrow: pip install 'vescale[data]'"
        ) from None
    table = parquet.read_table(path)
    _column(table.column_names, text_field, str(path))
    return [str(text) for text in table.column(text_field).to_pylist()]


def _datasets_documents(path: Path, text_field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise CLIUsageError(
            f"--data {str(path)!r} is a directory: a dataset saved by `datasets` needs that library "
            "(pip install datasets); or pass a .txt, .jsonl or .parquet file"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    _column(list(loaded.column_names), text_field, str(path))
    return [str(text) for text in loaded[text_field]]


def read_documents(data: str, text_field: str = "text") -> list[str]:
    """The documents of ``data``: a ``.txt`` file is one, a ``.jsonl`` line one each, a Parquet row one each.

    Example::

        read_documents("corpus.jsonl", "text")[0]
    """
    path = Path(data)
    if path.is_dir():
        return _datasets_documents(path, text_field)
    if not path.is_file():
        raise CLIUsageError(f"--data {data!r}: no such file or directory")
    if path.suffix == ".jsonl":
        return _json_documents(path, text_field)
    if path.suffix == ".parquet":
        return _parquet_documents(path, text_field)
    return [path.read_text()]


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _eos_id(tokenizer: object, eos_token_id: int | None) -> int:
    if eos_token_id is not None:
        return eos_token_id
    for name in _EOS_NAMES:
        found = tokenizer.token_to_id(name)  # type: ignore[attr-defined]
        if found is not None:
            return int(found)
    raise CLIUsageError(
        f"the tokenizer has none of the end-of-text tokens {', '.join(_EOS_NAMES)} and the model config "
        "no eos_token_id; set eos_token_id in config.json"
    )


def encode_documents(
    documents: list[str], tokenizer_path: str | None, eos_token_id: int | None
) -> torch.Tensor:
    """``documents`` as one int64 stream: each encoded and followed by EOS, or (no tokenizer) as bytes.

    Byte-level documents are joined by a blank line (bytes have no EOS token).

    Example::

        encode_documents(["a b", "c"], "tokenizer.json", eos_token_id=None)
    """
    if tokenizer_path is None:
        return torch.frombuffer(bytearray("\n\n".join(documents).encode()), dtype=torch.uint8).long()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = _eos_id(tokenizer, eos_token_id)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def corpus_tokens(source: CorpusSource, eos_token_id: int | None = None) -> torch.Tensor:
    """The packed token ids of ``source`` (int64), from the cache when it holds them, else encoded and cached.

    Example::

        corpus_tokens(CorpusSource("corpus.jsonl", "tokenizer.json"), eos_token_id=2).shape
    """
    data = Path(source.data)
    if not data.exists():
        raise CLIUsageError(f"--data {source.data!r}: no such file or directory; pass a .txt, .jsonl, "
                            ".parquet file or a directory saved by datasets")  # fmt: skip
    key = hashlib.sha256()
    key.update(_content_hash(data).encode())
    key.update((_content_hash(Path(source.tokenizer)) if source.tokenizer else "bytes").encode())
    key.update(f"{source.text_field}\0{eos_token_id}".encode())
    # Beside the data, a dataset directory included: inside it, the cache would change the directory's hash.
    cache = data.parent / _CACHE_DIR / f"{data.name}.{key.hexdigest()[:20]}.pt"
    if cache.is_file():
        cached: torch.Tensor = torch.load(cache, weights_only=True)
        return cached
    tokens = encode_documents(read_documents(source.data, source.text_field), source.tokenizer, eos_token_id)
    try:
        cache.parent.mkdir(exist_ok=True)
        pending = cache.with_name(f"{cache.name}.{os.getpid()}.writing")
        torch.save(tokens, pending)
        os.replace(pending, cache)
    except OSError:  # a read-only data directory: encode each time rather than fail
        pass
    return tokens


def tokenizer_vocabulary(tokenizer_path: str) -> int:
    """The number of token ids of the tokenizer file (special tokens included).

    Example::

        tokenizer_vocabulary("tokenizer.json")   # e.g. 512
    """
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_path).get_vocab_size(with_added_tokens=True)


def copy_tokenizer_files(tokenizer_path: str, destination: Path) -> list[Path]:
    """Copy ``tokenizer_path`` and the :data:`TOKENIZER_FILES` beside it into ``destination``.

    Example::

        copy_tokenizer_files("my-llama/tokenizer.json", Path("vescale_checkpoints/my-llama"))
    """
    source = Path(tokenizer_path)
    destination.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        found = source if name == "tokenizer.json" else source.parent / name
        if found.is_file():
            shutil.copyfile(found, destination / name)
            copied.append(destination / name)
    return copied
