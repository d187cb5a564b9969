"""Run inside a package's stand-alone environment: fail if more of veScale is installed
than the package declares (directly or through its siblings).

    python tools/check_alone.py dmodule
    python tools/check_alone.py vescale     # the meta-package: every component, its own __init__
"""

from __future__ import annotations

import importlib.util
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

COMPONENTS = ("dtensor", "dmodule", "doptim", "dcheckpoint", "dpipe", "planner")


def distribution_name(package: str) -> str:
    return "vescale" if package == "vescale" else f"vescale-{package}"


def declared_closure(package: str) -> set[str]:
    """The package and every sibling it requires, transitively."""
    closure, pending = set(), [package]
    while pending:
        name = pending.pop()
        if name in closure:
            continue
        closure.add(name)
        for requirement in distribution(distribution_name(name)).requires or []:
            match = re.match(r"vescale-([a-z]+)", requirement)
            if match and "extra ==" not in requirement:
                pending.append(match[1])
    return closure


def main(package: str) -> int:
    allowed = declared_closure(package)
    problems = [
        f"vescale.{other} is importable but {distribution_name(package)} does not declare it"
        for other in COMPONENTS
        if other not in allowed and importlib.util.find_spec(f"vescale.{other}") is not None
    ]
    namespace_origin = importlib.util.find_spec("vescale").origin
    if package == "vescale":
        if namespace_origin in (None, "namespace"):
            problems.append("the meta-package's vescale/__init__.py is not what `import vescale` finds")
    else:
        try:
            distribution("vescale")
            problems.append("the meta-package vescale is installed")
        except PackageNotFoundError:
            pass
        if namespace_origin not in (None, "namespace"):
            problems.append("vescale/__init__.py exists: a component must not ship it (PEP 420 namespace)")
    for problem in problems:
        print(f"check_alone: {problem}", file=sys.stderr)
    siblings = sorted(allowed - {package})
    print(f"check_alone: {distribution_name(package)} with {siblings}; nothing else of veScale")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
