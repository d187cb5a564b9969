"""``vescale.deferred_init``: build a model of any size without allocating its parameters.

``vescale.parallelize`` materialises it once, after every plan section has decided each
parameter's placements, so each rank allocates only its own shards (GUIDE section 3), with
the values eager construction would give.

Example::

    vescale.manual_seed(0)
    model = vescale.deferred_init(LlamaForCausalLM, config)   # no parameter memory yet
    model, optimizer, _, _ = vescale.parallelize(plan, model, optimizer_fn)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from vescale.dmodule import deferred_init as _dmodule_deferred_init

__all__ = ["deferred_init"]


def deferred_init(module_cls_or_fn: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """Construct ``module_cls_or_fn(*args, **kwargs)`` on fake tensors, recording its initialisation.

    Example::

        torch.manual_seed(0)
        model = vescale.deferred_init(GPT2LMHeadModel, config)
        plan = vescale.generate_plan(model, {"tensor_parallel.size": 2})
    """
    return _dmodule_deferred_init(module_cls_or_fn, *args, **kwargs)
