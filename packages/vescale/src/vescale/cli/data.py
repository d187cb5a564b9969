"""The training text as byte-level samples: the standard library's pydoc topics, or ``--data FILE``.

``pydoc_data.topics`` ships with every CPython (~460 KB of English and code), so the default
run needs nothing downloaded. Each byte is a token (vocabulary 256); the text is cut into
consecutive, non-overlapping samples of ``sequence_length`` tokens, labels equal to the inputs
(``transformers`` causal LMs shift them). Sample ``i`` is chunk ``torch.randperm(n, seed)[i]``:
the topics differ a lot (prose, grammar, code), and batches of neighbouring chunks would make the
loss curve jump from topic to topic. The order is fixed by the seed, so any loader reading the
dataset in order (the single-device reference, ``vescale.DistributedDataLoader``) sees the same
global batches.

Example::

    dataset = ByteTextDataset(default_text(), sequence_length=128, seed=0)
    dataset[0]["input_ids"].shape     # torch.Size([128])
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.utils.data import Dataset

from vescale.cli.errors import CLIUsageError

__all__ = [
    "BYTE_VOCABULARY",
    "ByteTextDataset",
    "TokenDataset",
    "default_text",
    "read_text",
    "split_for_eval",
    "training_tokens",
]

BYTE_VOCABULARY = 256
"""Tokens of byte-level text: one per byte value."""


def default_text() -> bytes:
    """The text of ``pydoc_data.topics`` (the help topics of every Python install), as UTF-8 bytes.

    Example::

        len(default_text())   # ~460_000
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode()


def read_text(path: str | None) -> bytes:
    """The bytes of ``--data`` (a text file), or :func:`default_text` when it is ``None``.

    Example::

        text = read_text("corpus.txt")
    """
    if path is None:
        return default_text()
    file = Path(path)
    if not file.is_file():
        raise CLIUsageError(
            f"--data {path!r}: no such file; pass a text file, or leave --data out for the default"
        )
    return file.read_bytes()


class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    """The ``sequence_length``-token chunks of ``tokens`` in a seeded order, as ``{"input_ids", "labels"}``.

    ``order`` (positions in the seeded order) keeps a part of the chunks: :func:`split_for_eval`
    holds the last ones out.

    Example::

        dataset = TokenDataset(torch.arange(1000), sequence_length=8)
    """

    def __init__(self, tokens: torch.Tensor, sequence_length: int, seed: int = 0) -> None:
        if len(tokens) < sequence_length:
            raise CLIUsageError(
                f"the training text has {len(tokens)} tokens, fewer than one sample of {sequence_length}; "
                "pass a longer --data file or a smaller sequence_length constraint"
            )
        self.tokens = tokens
        self.sequence_length = sequence_length
        chunks = len(self.tokens) // sequence_length
        self.order = torch.randperm(chunks, generator=torch.Generator().manual_seed(seed)).tolist()

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.order[index] * self.sequence_length
        sample = self.tokens[start : start + self.sequence_length].long()
        return {"input_ids": sample, "labels": sample.clone()}


class ByteTextDataset(TokenDataset):
    """The ``sequence_length``-byte chunks of ``text`` in a seeded order, as ``{"input_ids", "labels"}``.

    Example::

        batch = torch.utils.data.default_collate([ByteTextDataset(b"abc" * 100, 8)[i] for i in range(4)])
    """

    def __init__(self, text: bytes, sequence_length: int, seed: int = 0) -> None:
        super().__init__(torch.frombuffer(bytearray(text), dtype=torch.uint8), sequence_length, seed)


def split_for_eval(dataset: TokenDataset, fraction: float) -> tuple[TokenDataset, TokenDataset]:
    """``dataset`` without the last ``fraction`` of its seeded order, and those held-out samples.

    The training part keeps its order (a prefix of the whole run's), so the eval split does not
    change which samples train first.

    Example::

        train, held_out = split_for_eval(dataset, 0.05)
    """
    held = max(1, round(len(dataset) * fraction))
    if not 0 < fraction < 1 or held >= len(dataset):
        raise CLIUsageError(
            f"--eval-fraction {fraction}: keep some samples for training and hold out at least one "
            f"of {len(dataset)}; pass a fraction in (0, 1)"
        )
    train, held_out = copy.copy(dataset), copy.copy(dataset)
    train.order, held_out.order = dataset.order[:-held], dataset.order[-held:]
    return train, held_out


def training_tokens(
    data: str | None, tokenizer: str | None, text_field: str, eos_token_id: int | None
) -> torch.Tensor:
    """The run's token stream: bytes of the text (no tokenizer, no JSONL/Parquet/dataset), else the
    tokenized, EOS-packed documents (:mod:`vescale.cli.text_corpus`, cached beside the data).

    Example::

        tokens = training_tokens("corpus.jsonl", "tok/tokenizer.json", "text", eos_token_id=2)
    """
    from vescale.cli.text_corpus import CorpusSource, corpus_tokens, encode_documents

    structured = data is not None and (Path(data).is_dir() or Path(data).suffix in (".jsonl", ".parquet"))
    if tokenizer is None and not structured:
        return torch.frombuffer(bytearray(read_text(data)), dtype=torch.uint8)
    if data is None:
        return encode_documents([default_text().decode()], tokenizer, eos_token_id)
    return corpus_tokens(CorpusSource(data, tokenizer, text_field), eos_token_id)
