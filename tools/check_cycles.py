"""Check that no module imports itself back and no package imports a package above it.

    python tools/check_cycles.py                  # the repository's packages/*/src; exit 1 on a problem
    python tools/check_cycles.py --root /tmp/copy # another tree laid out as packages/<name>/src

Every import counts, wherever it stands: at module level, inside a function, under
``if TYPE_CHECKING:`` or ``try:``. A loop of imports, even a lazy one, means no single module
owns the concept the modules share. An import names the most specific module that exists
(``from vescale.dmodule import sharding_plan`` is ``vescale.dmodule.sharding_plan``;
``from vescale.dmodule import ShardingPlan`` is ``vescale.dmodule``, its ``__init__``).

Packages import only downwards (GUIDE.md): ``dtensor`` <- ``dmodule``, ``doptim``,
``dcheckpoint`` <- ``dpipe`` <- ``planner`` <- ``vescale`` (the meta-package: ``vescale``,
``vescale.api``, ``vescale.cli``). Packages on the same level do not import one another; they
meet through a protocol in ``dtensor``. Only ``src/`` is checked: tests may compose packages.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A package may import the packages on lower levels only.
LEVELS = {"dtensor": 0, "dmodule": 1, "doptim": 1, "dcheckpoint": 1, "dpipe": 2, "planner": 3, "vescale": 4}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``importer`` imports ``imported`` at ``path:line``."""

    importer: str
    imported: str
    path: Path
    line: int


def module_files(root: Path) -> dict[str, Path]:
    """``{module name: file}`` for every ``packages/*/src/**/*.py`` under ``root``."""
    modules = {}
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        src = next(parent for parent in path.parents if parent.name == "src")
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _package_of(module: str) -> str:
    """The distribution a ``vescale`` module belongs to: its component, or the meta-package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LEVELS and parts[1] != "vescale" else "vescale"


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def _absolute(node: ast.ImportFrom, importer: str, modules: dict[str, Path]) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not _is_package(importer, modules):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module under the root (``None`` for third parties)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, modules: dict[str, Path]) -> Iterator[Import]:
    """Every edge from ``module`` to another module under the root."""
    path = modules[module]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, modules)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            imported = _known(name, modules)
            if imported is not None and imported != module:
                yield Import(module, imported, path, node.lineno)


def _cycles(graph: dict[str, list[Import]]) -> list[tuple[list[Import], list[str]]]:
    """Each group of modules that import one another (Tarjan's strongly connected components):
    one loop of imports through it, and all its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for edge in graph[module]:
            if edge.imported not in index:
                visit(edge.imported)
                low[module] = min(low[module], low[edge.imported])
            elif edge.imported in on_stack:
                low[module] = min(low[module], index[edge.imported])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for module in sorted(graph):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return [(_loop_in(group, graph), sorted(group)) for group in sorted(groups, key=min)]


def _loop_in(group: set[str], graph: dict[str, list[Import]]) -> list[Import]:
    """The shortest loop of imports from the group's first module back to it (breadth-first)."""
    start = min(group)
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for edge in graph[module]:
                if edge.imported not in group or edge.imported in came_from:
                    continue
                came_from[edge.imported] = edge
                if edge.imported == start:
                    loop = [edge]
                    while loop[0].importer != start:
                        loop.insert(0, came_from[loop[0].importer])
                    return loop
                following.append(edge.imported)
        frontier = following
    raise AssertionError(f"no loop through {start} in its strongly connected group")


def check(root: Path) -> list[str]:
    """Every import loop and every upward import between packages under ``root``, as messages."""
    modules = module_files(root)
    graph = {module: list(imports_of(module, modules)) for module in modules}
    problems = []
    for loop, group in _cycles(graph):
        chain = " -> ".join([loop[0].importer, *(edge.imported for edge in loop)])
        where = ", ".join(f"{edge.path.relative_to(root)}:{edge.line}" for edge in loop)
        others = sorted(set(group) - {edge.importer for edge in loop})
        also = f"; the loops also pass through {', '.join(others)}" if others else ""
        problems.append(
            f"import loop {chain} (at {where}){also}; give the shared concept one owner: move it into "
            "a module that the others import and that imports none of them"
        )
    for edges in graph.values():
        for edge in edges:
            importer, imported = _package_of(edge.importer), _package_of(edge.imported)
            if importer != imported and LEVELS[imported] >= LEVELS[importer]:
                problems.append(
                    f"{edge.path.relative_to(root)}:{edge.line}: {edge.importer} ({importer}) imports "
                    f"{edge.imported} ({imported}), which is not below it (dtensor <- dmodule, doptim, "
                    "dcheckpoint <- dpipe <- planner <- vescale); move the shared piece down, into "
                    "vescale.dtensor if two packages of one level need it"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a tree with packages/<name>/src")
    arguments = parser.parse_args(argv)
    problems = check(arguments.root)
    for problem in problems:
        print(f"check_cycles: {problem}", file=sys.stderr)
    if not problems:
        count = len(module_files(arguments.root))
        print(f"check_cycles: no import loop and no upward import among {count} modules")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
