"""Which tensor of a Hugging Face checkpoint fills each key of a model, checked by all ranks together.

A key is filled from the file tensor of the same name. A key the files lack is still filled
when it is tied to a key they hold (``save_pretrained`` writes one name per tied tensor):

* an alias on this rank: another state-dict key of the *same tensor* is in the files, and
  reading that key fills both;
* a tie the model declares (``transformers``' ``all_tied_weights_keys``, ``{tied: source}``)
  whose source this rank does not hold: a pipeline stage with ``lm_head`` but not the input
  embedding reads the embedding's bytes from the files into its ``lm_head.weight``.

Under pipeline parallelism no rank holds every key, so missing and unexpected keys are
decided over all ranks: a file key is unexpected when no rank reads it. Every rank raises
the same error, so none is left waiting in the read's collectives.

Example::

    match = match_keys(model.state_dict(), aliases, declared_ties(model), set(index.tensors))
    check_on_every_rank(match, set(index.tensors), hf_dir, strict=True)
    read_targets(directory, index_view, {key: live[key] for key in match.sources})
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from vescale.dcheckpoint._collectives import all_gather_bytes, rank_and_world_size
from vescale.dcheckpoint.errors import CheckpointMismatchError

__all__ = [
    "KeyMatch",
    "check_on_every_rank",
    "declared_ties",
    "match_keys",
    "quoted_names",
    "tensor_aliases",
]


@dataclass
class KeyMatch:
    """``sources``: each key to read and the file key it is read from; keys filled through an
    alias; keys no file tensor fills; and ``problems`` (shape errors) found on this rank."""

    sources: dict[str, str] = field(default_factory=dict)
    through_alias: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    @property
    def used(self) -> set[str]:
        """The file keys this rank reads."""
        return set(self.sources.values())


def tensor_aliases(model: nn.Module) -> dict[str, set[str]]:
    """Each state-dict key and the other keys of the same tensor on this rank (tied parameters).

    Example::

        tensor_aliases(tied_llama)["lm_head.weight"]   # {"model.embed_tokens.weight"}
    """
    by_tensor: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), set()).add(name)
    return {name: names - {name} for names in by_tensor.values() for name in names}


def declared_ties(model: nn.Module) -> dict[str, str]:
    """The ``{tied key: source key}`` ties of the outermost ``transformers`` model in ``model``.

    Taken from the first module (outermost first) with an ``all_tied_weights_keys`` dict, whose
    keys are relative to it, as the files' are; ``{}`` for models without one.

    Example::

        declared_ties(tied_gpt2)   # {"lm_head.weight": "transformer.wte.weight"}
    """
    for module in model.modules():
        ties = getattr(module, "all_tied_weights_keys", None)
        if isinstance(ties, dict):
            return {str(tied): str(source) for tied, source in ties.items()}
    return {}


def match_keys(
    live: Mapping[str, torch.Tensor],
    aliases: Mapping[str, set[str]],
    ties: Mapping[str, str],
    in_files: Mapping[str, tuple[int, ...]],
) -> KeyMatch:
    """Match this rank's state-dict keys to the file keys (``in_files``: key to global shape).

    Example::

        match = match_keys(model.state_dict(), tensor_aliases(model), declared_ties(model), shapes)
        match.sources["lm_head.weight"]   # "transformer.wte.weight" on a stage without the embedding
    """
    match = KeyMatch()
    for name in sorted(live):
        if name in in_files:
            source = name
        elif aliases.get(name, set()) & set(in_files):
            match.through_alias.add(name)
            continue
        elif ties.get(name) in in_files:
            source = ties[name]
        else:
            match.missing.add(name)
            continue
        if in_files[source] != tuple(live[name].shape):
            match.problems.append(
                f"{name!r}: the Hugging Face file holds shape {in_files[source]}"
                + (f" (under {source!r})" if source != name else "")
                + f", the model has {tuple(live[name].shape)}; build the model from the checkpoint's "
                "config.json"
            )
        match.sources[name] = source
    return match


def quoted_names(names: set[str]) -> str:
    """Up to five names, quoted and sorted, and how many more: for error messages."""
    ordered = sorted(names)
    return ", ".join(repr(n) for n in ordered[:5]) + (
        f" and {len(ordered) - 5} more" if len(ordered) > 5 else ""
    )


def check_on_every_rank(match: KeyMatch, in_files: set[str], hf_dir: str, *, strict: bool) -> None:
    """Raise the same :class:`CheckpointMismatchError` on every rank if any rank found a problem,
    or, with ``strict``, if a key is missing on some rank or no rank reads a file key.

    Example::

        check_on_every_rank(match, set(index.tensors), "hf-model", strict=True)
    """
    rank, world_size = rank_and_world_size()
    payload = {"missing": sorted(match.missing), "used": sorted(match.used), "problems": match.problems}
    gathered = (
        [payload]
        if world_size == 1
        else [json.loads(raw) for raw in all_gather_bytes(json.dumps(payload).encode())]
    )

    def where(other: int) -> str:
        return f" (on rank {other})" if world_size > 1 else ""

    for other, found in enumerate(gathered):
        if found["problems"]:
            raise CheckpointMismatchError(found["problems"][0] + where(other))
    if not strict:
        return
    missing = {name for found in gathered for name in found["missing"]}
    unexpected = in_files - {name for found in gathered for name in found["used"]}
    if missing or unexpected:
        first_missing = next((other for other, found in enumerate(gathered) if found["missing"]), rank)
        raise CheckpointMismatchError(
            f"the model does not match the Hugging Face checkpoint {hf_dir!r}: missing "
            f"{quoted_names(missing) or 'none'}{where(first_missing) if missing else ''}; unexpected "
            f"{quoted_names(unexpected) or 'none'}. Build the model from the checkpoint's config.json, or "
            "pass strict=False"
        )
