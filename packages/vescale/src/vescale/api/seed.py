"""``vescale.manual_seed``: the random numbers of a single-device run, on every rank.

Example::

    vescale.manual_seed(1234)          # on every rank, like torch.manual_seed in one process
    model = vescale.deferred_init(MyModel)
    model, optimizer, _, _ = vescale.parallelize(plan, model, optimizer_fn)
"""

from __future__ import annotations

from vescale.dtensor import manual_seed as _dtensor_manual_seed

__all__ = ["manual_seed"]


def manual_seed(seed: int) -> None:
    """Seed every rank so that random ops (initialisation, dropout) give single-device values.

    Call it with the same ``seed`` on every rank, where one process would call
    ``torch.manual_seed``.

    Example::

        vescale.manual_seed(0)
        model = vescale.deferred_init(LlamaForCausalLM, config)
        out = model(**batch)   # dropout masks equal to those of one process
    """
    _dtensor_manual_seed(seed)
