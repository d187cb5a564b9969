"""The sequence length a plan is profiled at when the user sets none, and a model that refuses it.

The default is 2048 tokens, capped by the longest sequence the config names
(``max_position_embeddings``, ``n_positions``, ...). A config that fixes the training length
exactly decides it: Reformer's axial position embeddings (``axial_pos_shape``) train only on
sequences of exactly the product of their factors. Some models fail below their named maximum
(ProphetNet's relative-position buckets cover ``max_position_embeddings - 2`` positions), so when
the profile's forward fails at the default length, shorter ones are tried, halving each time,
with a warning; a length the user gave as a constraint is never changed.

Example::

    length, reason = default_sequence_length(model)
    profile, length, reason = profile_at_default_length(model, length, reason)
"""

from __future__ import annotations

import logging
import math

from torch import nn

from vescale.planner.errors import PlanError
from vescale.planner.profile import ModelProfile, profile_model

__all__ = ["default_sequence_length", "profile_at_default_length"]

_LOGGER = logging.getLogger("vescale.planner")
_DEFAULT_SEQUENCE_LENGTH = 2048
# The config names under which transformers' models give their longest sequence (MPT: max_seq_len,
# whose ALiBi table has that many positions).
_LONGEST_SEQUENCE_NAMES = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")
# The config names whose factors multiply to the only length the model trains at (Reformer's axial
# position embeddings raise "make sure that config.axial_pos_shape factors ... multiply to sequence length").
_EXACT_SEQUENCE_NAMES = ("axial_pos_shape",)


def _exact_sequence_length(config: object) -> tuple[int, str] | None:
    for name in _EXACT_SEQUENCE_NAMES:
        factors = getattr(config, name, None)
        whole = isinstance(factors, list | tuple) and all(isinstance(f, int) and f > 0 for f in factors)
        if whole and factors:
            product = math.prod(factors)
            shape = " x ".join(str(factor) for factor in factors)
            return product, f"the model trains only at its {name} ({shape} = {product} positions)"
    return None


def default_sequence_length(model: nn.Module) -> tuple[int, str]:
    """The length to profile ``model`` at without a ``sequence_length`` constraint, and why.

    Example::

        default_sequence_length(gpt2_with_1024_positions)   # (1024, "the model's longest sequence ...")
    """
    config = getattr(model, "config", None)
    exact = _exact_sequence_length(config)
    if exact is not None:
        return exact
    limits = [getattr(config, name, None) for name in _LONGEST_SEQUENCE_NAMES]
    longest = min((limit for limit in limits if isinstance(limit, int) and limit > 0), default=None)
    if longest is not None and longest < _DEFAULT_SEQUENCE_LENGTH:
        return longest, f"the model's longest sequence ({longest} positions)"
    return (
        _DEFAULT_SEQUENCE_LENGTH,
        f"default {_DEFAULT_SEQUENCE_LENGTH} (set the sequence_length constraint)",
    )


def profile_at_default_length(model: nn.Module, length: int, reason: str) -> tuple[ModelProfile, int, str]:
    """The profile of one sample at ``length`` tokens, else at the longest half of it that runs.

    Raises the error at ``length`` when no shorter length runs either.

    Example::

        profile, length, reason = profile_at_default_length(prophetnet, 64, "its longest sequence")
        length   # 32: ProphetNet's buckets cover 62 positions of its 64
    """
    try:
        return profile_model(model, length, 1), length, reason
    except PlanError as refused:
        shorter = length // 2
        while shorter >= 1:
            try:
                profile = profile_model(model, shorter, 1)
            except PlanError:
                shorter //= 2
                continue
            first_line = str(refused).splitlines()[0]
            _LOGGER.warning(
                "%s; profiled at %d tokens instead (set the sequence_length constraint to the length "
                "you train at)",
                first_line,
                shorter,
            )
            return profile, shorter, f"{reason} fails ({first_line}); {shorter} runs"
        raise
