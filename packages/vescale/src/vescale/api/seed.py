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
    """Seed every rank so that random ops give single-device values: initialisation, ops on
    DTensors (tensor-parallel activations: dropout there too), and, on CPU, dropout on a piece
    of the global batch (a dp rank's rows, a micro-batch, a pipeline stage's micro-batch).

    Call it with the same ``seed`` on every rank, where one process would call
    ``torch.manual_seed``. A forward on some rows of the global batch draws those rows of the
    masks one device draws for the whole batch (:mod:`vescale.dtensor.batch_random`), and every
    rank's generator ends where one device's would; a pipeline stage starts from the state one
    device holds where its layers begin (:mod:`vescale.dpipe.random_carry`). Not covered, each
    piece drawing for its own rows as if they were the whole batch (a ``NotSingleDeviceWarning``
    says so once): ``compile=True``, CUDA (its Philox generator cannot skip to a piece's rows:
    each rank would draw the whole global batch's masks), and ``transformers``' own gradient
    checkpointing in a call of one piece (``micro_batch_size`` = the rank's rows) whose backward
    the caller runs.

    Example::

        vescale.manual_seed(0)
        model = vescale.deferred_init(GPT2LMHeadModel, config)     # dropout 0.1 by default
        out = model(**batch)   # under dp x tp on CPU: dropout masks equal to one process's
    """
    _dtensor_manual_seed(seed)
