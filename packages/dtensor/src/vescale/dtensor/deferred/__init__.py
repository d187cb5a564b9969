"""Deferred initialisation: construct a module without allocating it, then materialise each
rank's shards with the values eager single-device construction gives, bitwise.

``deferred_init`` records, at the dispatch level, every op that initialises each parameter
and buffer (:mod:`.record` is the protocol; :mod:`.recorder` explains how random draws stay
exact); ``materialize_module``/``materialize_tensor`` replay them one tensor at a time.
``vescale.dmodule.deferred_init`` is the user-facing entry; dmodule (TP), doptim (ZeRO-3)
and dpipe materialise from the same record once every plan section has chosen placements.

Example::

    torch.manual_seed(0)
    model = deferred_init(LlamaForCausalLM, config)
    materialize_module(model, {"lm_head.weight": (mesh, [Shard(0)])})
"""

from vescale.dtensor.deferred.construct import deferred_init, module_tensors
from vescale.dtensor.deferred.errors import DeferredInitError, DeferredPlacementError, NotDeferredError
from vescale.dtensor.deferred.materialize import PlacementSpec, materialize_module, materialize_tensor
from vescale.dtensor.deferred.record import DeferredHandle, InitRecord, RecordedOp, TensorRef, is_deferred
from vescale.dtensor.deferred.value_reads import DeferredValueReadError

__all__ = [
    "DeferredHandle",
    "DeferredInitError",
    "DeferredPlacementError",
    "DeferredValueReadError",
    "InitRecord",
    "NotDeferredError",
    "PlacementSpec",
    "RecordedOp",
    "TensorRef",
    "deferred_init",
    "is_deferred",
    "materialize_module",
    "materialize_tensor",
    "module_tensors",
]
