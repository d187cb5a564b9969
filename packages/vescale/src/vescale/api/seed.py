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
    """Seed every rank so that random ops give single-device values: initialisation, and ops on
    DTensors (tensor-parallel activations: dropout there too).

    Call it with the same ``seed`` on every rank, where one process would call
    ``torch.manual_seed``. Not covered: the batch split. A data-parallel rank's activations (or
    a micro-batch's) hold only its rows, and a random op on them (dropout) draws as for those
    rows alone, tensor-parallel or not, so its mask is not the one a single device draws for
    those rows of the global batch (and every dp rank draws the same masks).

    Example::

        vescale.manual_seed(0)
        model = vescale.deferred_init(LlamaForCausalLM, config)
        out = model(**batch)   # under tensor parallelism: dropout masks equal to one process's
    """
    _dtensor_manual_seed(seed)
