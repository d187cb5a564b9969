"""Check that each package imports only what its pyproject.toml declares.

    python tools/check_imports.py          # every package; exit 1 naming each offending import

A component's code may import the standard library, its declared dependencies and the
``vescale.<sibling>`` packages it declares; its tests may also import its ``test`` extra, and
so may its shipped test-support code (``src/vescale/<name>/testing/``), but only inside
functions, so that importing the testing package never needs the extra.
No component may import the meta-package (``import vescale`` or ``from vescale import x``).
Imports guarded by ``try: ... except ImportError`` are optional and not checked.
The check is static (it reads the code): CI also installs each component alone and runs
its tests (tools/check_components.sh), which catches what is imported dynamically.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# Distribution names whose import name differs.
IMPORT_NAMES = {"pytest-xdist": "xdist", "pytest-timeout": "pytest_timeout"}


def _distribution_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def _allowed_modules(requirements: list[str]) -> set[str]:
    allowed = set()
    for requirement in requirements:
        name = _distribution_name(requirement)
        if name == "vescale":
            continue
        if name.startswith("vescale-"):
            allowed.add("vescale." + name.removeprefix("vescale-"))
        else:
            allowed.add(IMPORT_NAMES.get(name, name.replace("-", "_")))
    return allowed


def _is_optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                names = ast.unparse(handler.type) if handler.type else ""
                if "ImportError" in names or "ModuleNotFoundError" in names:
                    return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True
    return False


def _imported_modules(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """``(line, module, lazy)`` for every import that is not optional; lazy: inside a function."""
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vescale":
                modules = [f"vescale.{alias.name}" for alias in node.names]
            else:
                modules = [node.module]
        else:
            continue
        if not _is_optional(node, parents):
            lazy = _in_function(node, parents)
            found.extend((node.lineno, module, lazy) for module in modules)
    return found


def _offending(module: str, own: str, allowed: set[str]) -> bool:
    top = module.split(".")[0]
    if top != "vescale":
        return top not in sys.stdlib_module_names and top not in allowed
    component = ".".join(module.split(".")[:2])
    return component not in allowed and component != own


def check_package(package_dir: Path) -> list[str]:
    project = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]
    name = project["name"]
    if name == "vescale":
        return []  # the meta-package may import every component
    own = "vescale." + name.removeprefix("vescale-")
    runtime = _allowed_modules(project.get("dependencies", []))
    test = runtime | _allowed_modules(project.get("optional-dependencies", {}).get("test", []))
    problems = []
    testing_dir = package_dir / "src" / "vescale" / own.split(".")[1] / "testing"
    for folder, allowed in (("src", runtime), ("tests", test)):
        for source in sorted((package_dir / folder).rglob("*.py")):
            tree = ast.parse(source.read_text(), filename=str(source))
            test_support = testing_dir in source.parents
            for line, module, lazy in _imported_modules(tree):
                if _offending(module, own, test if test_support and lazy else allowed):
                    problems.append(
                        f"{source.relative_to(ROOT)}:{line}: imports {module!r}, which {name} does not "
                        f"declare; add it to {package_dir.relative_to(ROOT)}/pyproject.toml "
                        "or remove the import"
                    )
    return problems


def main() -> int:
    packages = sorted(ROOT.glob("packages/*/"))
    problems = [problem for package in packages for problem in check_package(package)]
    for problem in problems:
        print(f"check_imports: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_imports: each of the {len(packages)} packages imports only what it declares")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
