"""Run inside a component's stand-alone environment: fail if more of veScale is installed
than the component declares (directly or through its siblings).

    python tools/check_alone.py dmodule
"""

from __future__ import annotations

import importlib.util
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution

COMPONENTS = ("dtensor", "dmodule", "doptim", "dcheckpoint", "dpipe", "planner")


def declared_closure(component: str) -> set[str]:
    """The component and every sibling it requires, transitively."""
    closure, pending = set(), [component]
    while pending:
        name = pending.pop()
        if name in closure:
            continue
        closure.add(name)
        for requirement in distribution(f"vescale-{name}").requires or []:
            match = re.match(r"vescale-([a-z]+)", requirement)
            if match and "extra ==" not in requirement:
                pending.append(match[1])
    return closure


def main(component: str) -> int:
    allowed = declared_closure(component)
    problems = [
        f"vescale.{other} is importable but vescale-{component} does not declare it"
        for other in COMPONENTS
        if other not in allowed and importlib.util.find_spec(f"vescale.{other}") is not None
    ]
    try:
        distribution("vescale")
        problems.append("the meta-package vescale is installed")
    except PackageNotFoundError:
        pass
    if importlib.util.find_spec("vescale").origin not in (None, "namespace"):
        problems.append("vescale/__init__.py exists: a component must not ship it (PEP 420 namespace)")
    for problem in problems:
        print(f"check_alone: {problem}", file=sys.stderr)
    print(f"check_alone: vescale-{component} with {sorted(allowed - {component})}; nothing else of veScale")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
