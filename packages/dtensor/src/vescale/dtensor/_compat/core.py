"""The supported torch range, the one error type and the private-attribute readers.

Private PyTorch APIs: none of its own; ``_private_attribute`` and ``_private_class`` read
every private module attribute the sibling modules of ``vescale.dtensor._compat`` name, and
raise :class:`PrivateTorchAPIError` when a release renamed, removed or retyped one.
doptim's and dpipe's ``_compat.py`` import ``MIN_TORCH``, ``TESTED_TORCH``,
``PrivateTorchAPIError``, ``torch_version`` and ``unsupported_torch`` from here (through the
package).

Example::

    from vescale.dtensor._compat.core import unsupported_torch
    raise unsupported_torch("torch._subclasses.fake_tensor is missing", "vescale.dpipe")
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = [
    "MIN_TORCH",
    "TESTED_TORCH",
    "PrivateTorchAPIError",
    "torch_version",
    "unsupported_torch",
]

# The torch range for the private attributes of every package's _compat.py (doptim, dpipe
# import these): one range, since the packages are released in lockstep.
MIN_TORCH = (2, 11)
# The newest release these private attributes were checked against.
TESTED_TORCH = (2, 13)


class PrivateTorchAPIError(RuntimeError):
    """A private PyTorch attribute that veScale relies on is missing or changed its type.

    Every package's ``_compat.py`` raises this one type (from :func:`unsupported_torch`), so a
    caller catches a changed PyTorch the same way whichever package noticed it.
    """


def unsupported_torch(problem: str, package: str = "vescale.dtensor") -> PrivateTorchAPIError:
    """The error for ``problem`` ("<private attribute> is missing") that ``package`` hits in this torch.

    It names the supported torch range and the ``_compat`` of ``package`` to update (a module,
    or vescale.dtensor's package of them).

    Example::

        raise unsupported_torch("torch._subclasses.fake_tensor is missing", "vescale.dpipe")
    """
    compat = "_compat/" if package == "vescale.dtensor" else "_compat.py"
    return PrivateTorchAPIError(
        f"{problem} in torch {torch.__version__}; {package} was checked against torch "
        f"{MIN_TORCH[0]}.{MIN_TORCH[1]} to {TESTED_TORCH[0]}.{TESTED_TORCH[1]}. Install a torch in "
        f"that range, or update {package.replace('.', '/')}/{compat} for this release."
    )


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor), e.g. ``(2, 13)``."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _private_attribute(module_name: str, attribute: str, expected_type: type | None) -> Any:
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise unsupported_torch(f"{module_name}.{attribute} does not exist")
    value = getattr(module, attribute)
    if expected_type is not None and not isinstance(value, expected_type):
        raise PrivateTorchAPIError(
            f"{module_name}.{attribute} is a {type(value).__name__} in torch {torch.__version__}, "
            f"expected {expected_type.__name__}; update vescale/dtensor/_compat/ for this release."
        )
    return value


def _private_class(module_name: str, attribute: str) -> type:
    found: type = _private_attribute(module_name, attribute, type)
    return found
