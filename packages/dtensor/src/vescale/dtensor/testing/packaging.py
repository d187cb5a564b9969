"""Checks that an installed veScale component is the distribution it claims to be.

Every component's tests call :func:`check_component_distribution`, so that the same test
proves the editable development install and the stand-alone wheel install that CI makes
for each component (without the meta-package and without undeclared siblings).

Example::

    siblings = check_component_distribution("dmodule")   # -> ["dtensor"]
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import distribution

__all__ = ["check_component_distribution"]

_REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)\s*(?P<specifier>[^;]*)(;.*)?$")


def check_component_distribution(component: str) -> list[str]:
    """Import ``vescale.<component>`` and check its metadata; return its declared siblings.

    Raises AssertionError naming the problem when ``__version__`` differs from the
    distribution's version, or a sibling requirement is not pinned ``==`` to that same
    version (veScale releases every package in lockstep).
    """
    module = importlib.import_module(f"vescale.{component}")
    installed = distribution(f"vescale-{component}")
    assert module.__version__ == installed.version, (
        f"vescale.{component}.__version__ is {module.__version__} but the installed distribution "
        f"vescale-{component} is {installed.version}; reinstall it (bash tools/setup.sh)."
    )
    siblings = []
    for requirement in installed.requires or []:
        match = _REQUIREMENT.match(requirement)
        assert match is not None, f"unparsable requirement {requirement!r} of vescale-{component}"
        name, specifier = match["name"], match["specifier"].strip()
        if "extra ==" in requirement or not name.startswith("vescale"):
            continue
        assert specifier == f"=={installed.version}", (
            f"vescale-{component} requires {requirement!r}: siblings must be pinned "
            f"=={installed.version}; run python tools/bump_version.py {installed.version}."
        )
        siblings.append(name.removeprefix("vescale-"))
    return siblings
