"""Patterns over FQNs: compiling a plan's regular expressions, and naming the closest FQNs
when one matches nothing, so that an error can say what the user probably meant.

Example::

    compiled_pattern(r"model\\.layers\\.\\d+\\.mlp")          # re.Pattern, or ShardingPlanError
    closest_names("h.0.mlp", ["transformer.h.0.mlp", "lm_head"])   # ["transformer.h.0.mlp"]
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable

from vescale.dmodule.errors import ShardingPlanError

__all__ = ["closest_names", "compiled_pattern", "no_match_message"]


@functools.lru_cache(maxsize=1024)
def compiled_pattern(pattern: str) -> re.Pattern[str]:
    """``re.compile(pattern)``; a pattern that is no regular expression is a ``ShardingPlanError``."""
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ShardingPlanError(
            f"plan pattern '{pattern}' is not a valid regular expression ({error}); patterns are matched "
            r"with re.fullmatch, so escape literal dots: 'model\.layers\.\d+\.mlp'"
        ) from None


def closest_names(pattern: str, candidates: Iterable[str], count: int = 3) -> list[str]:
    """Up to ``count`` candidates most likely meant by ``pattern``, best first.

    First the names that the pattern matches only part of (the usual mistake: a missing
    prefix, as in ``h\\.\\d+\\.mlp`` for ``transformer.h.0.mlp``), shortest first; then the
    names most similar to the pattern's text with its escapes dropped.
    """
    candidates = list(dict.fromkeys(candidates))
    try:
        regex = re.compile(pattern)
    except re.error:
        regex = None
    partial = []
    if regex is not None:
        ending = [name for name in candidates if any(m.end() == len(name) for m in regex.finditer(name))]
        inside = [name for name in candidates if regex.search(name)]
        partial = sorted(ending, key=len) + sorted(inside, key=len)
    similar = difflib.get_close_matches(re.sub(r"\\(.)", r"\1", pattern), candidates, n=count, cutoff=0.0)
    return list(dict.fromkeys(partial + similar))[:count]


def no_match_message(section: str, key: str, pattern: str, kind: str, candidates: Iterable[str]) -> str:
    """The error text for the plan entry ``key`` whose ``pattern`` matches no parameter or module."""
    closest = closest_names(pattern, candidates)
    hint = f"; closest: {', '.join(repr(name) for name in closest)}" if closest else ""
    return (
        f"{section} pattern '{key}' matched no {kind}{hint}. Patterns are regular expressions "
        "matched with re.fullmatch against the whole FQN; fix the pattern or remove the entry"
    )
