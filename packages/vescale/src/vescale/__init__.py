"""veScale: train a single-device PyTorch model on many devices as if on one.

The component packages (``vescale.dtensor``, ``vescale.dmodule``, ``vescale.doptim``,
``vescale.dcheckpoint``, ``vescale.dpipe``, ``vescale.planner``) are separate
distributions sharing the ``vescale`` namespace. This meta-package alone owns this file:
it extends ``__path__`` so that components installed in other locations stay importable,
and loads them lazily, on first attribute access, so ``import vescale`` stays cheap.

Example::

    import vescale
    mesh_api = vescale.dtensor          # imported on first use
    print(vescale.__version__)
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import version as _distribution_version
from typing import TYPE_CHECKING, Any

# Components live in other sys.path entries (one per distribution, or one per editable
# install); extend_path makes each of them a part of this package.
__path__ = pkgutil.extend_path(__path__, __name__)

__version__ = _distribution_version("vescale")

COMPONENTS = ("dtensor", "dmodule", "doptim", "dcheckpoint", "dpipe", "planner")

# Public name -> module that defines it: the unified API (issue #8).
_LAZY_ATTRIBUTES: dict[str, str] = {
    "deferred_init": "vescale.api.deferred",
    "manual_seed": "vescale.api.seed",
    "parallelize": "vescale.api.parallelize",
    "DistributedDataLoader": "vescale.api.data_loader",
    "save": "vescale.api.checkpointing",
    "load": "vescale.api.checkpointing",
    "Plan": "vescale.planner",
    "generate_plan": "vescale.planner",
}

__all__ = ["COMPONENTS", "__version__", *COMPONENTS, *_LAZY_ATTRIBUTES]

if TYPE_CHECKING:
    # "X as X": re-exported for the type checker (the lazy __all__ above is built at run time).
    from vescale import dcheckpoint as dcheckpoint
    from vescale import dmodule as dmodule
    from vescale import doptim as doptim
    from vescale import dpipe as dpipe
    from vescale import dtensor as dtensor
    from vescale import planner as planner
    from vescale.api.checkpointing import load as load
    from vescale.api.checkpointing import save as save
    from vescale.api.data_loader import DistributedDataLoader as DistributedDataLoader
    from vescale.api.deferred import deferred_init as deferred_init
    from vescale.api.parallelize import parallelize as parallelize
    from vescale.api.seed import manual_seed as manual_seed
    from vescale.planner import Plan as Plan
    from vescale.planner import generate_plan as generate_plan


def __getattr__(name: str) -> Any:
    if name in COMPONENTS:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    if name in _LAZY_ATTRIBUTES:
        value = getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vescale' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
