"""tools/check_cycles.py, CI's import-loop and dependency-direction check, on copies of the packages'
sources with one deliberately wrong import added: each must be reported, naming the modules."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load_check_cycles():
    spec = importlib.util.spec_from_file_location("check_cycles", ROOT / "tools" / "check_cycles.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_cycles = _load_check_cycles()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of every package's src/, laid out as in the repository."""
    for src in sorted(ROOT.glob("packages/*/src")):
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(src, tmp_path / src.relative_to(ROOT), ignore=ignore)
    return tmp_path


def test_the_repository_has_no_import_loop_and_no_upward_import():
    assert check_cycles.check(ROOT) == []


def _add(tree: Path, relative: str, code: str) -> None:
    path = tree / relative
    path.write_text(path.read_text() + "\n\n" + code + "\n")


DMODULE = "packages/dmodule/src/vescale/dmodule"
DOPTIM = "packages/doptim/src/vescale/doptim"
DTENSOR = "packages/dtensor/src/vescale/dtensor"

WRONG_IMPORTS = {
    # A loop closed inside a function still is a loop: the modules share a concept nobody owns.
    "function-level loop": (
        f"{DMODULE}/_tensor_placements.py",
        "def _plan_type():\n"
        "    from vescale.dmodule.sharding_plan import ShardingPlan\n\n"
        "    return ShardingPlan",
        ["import loop", "vescale.dmodule._tensor_placements", "vescale.dmodule.sharding_plan"],
    ),
    # The doptim loop as it was: type-only imports back from the state functions to the optimizer.
    "TYPE_CHECKING loop": (
        f"{DOPTIM}/sharded_optimizer.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    from vescale.doptim.optimizer import DistributedOptimizer",
        ["import loop", "vescale.doptim.optimizer", "vescale.doptim.sharded_optimizer"],
    ),
    "relative-import loop": (
        f"{DMODULE}/_plan_resolution.py",
        "from . import sharding_plan",
        ["import loop", "vescale.dmodule._plan_resolution", "vescale.dmodule.sharding_plan"],
    ),
    "upward import": (
        f"{DTENSOR}/placements.py",
        "import vescale.planner",
        ["placements.py", "vescale.dtensor.placements (dtensor) imports vescale.planner (planner)"],
    ),
    "same-level import": (
        f"{DMODULE}/deferred.py",
        "from vescale.doptim import data_parallel",
        ["vescale.dmodule.deferred (dmodule) imports vescale.doptim.data_parallel (doptim)"],
    ),
    "component importing the meta-package": (
        f"{DTENSOR}/placements.py",
        "def _api():\n    from vescale import parallelize\n\n    return parallelize",
        ["vescale.dtensor.placements (dtensor) imports vescale (vescale)"],
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_IMPORTS))
def test_a_deliberately_introduced_wrong_import_is_reported(tree: Path, case: str, capsys):
    before = check_cycles.check(tree)
    relative, code, expected = WRONG_IMPORTS[case]
    _add(tree, relative, code)
    added = [problem for problem in check_cycles.check(tree) if problem not in before]
    # An upward import usually closes a loop across packages too, reported besides.
    assert [problem for problem in added if all(text in problem for text in expected)], added
    assert check_cycles.main(["--root", str(tree)]) == 1
    printed = capsys.readouterr().err
    assert all(problem in printed for problem in added)


def test_a_downward_import_is_fine(tree: Path):
    before = check_cycles.check(tree)
    _add(tree, "packages/dpipe/src/vescale/dpipe/__init__.py", "import vescale.dmodule.sharding_plan")
    _add(tree, f"{DMODULE}/deferred.py", "from vescale.dtensor import placements")
    assert check_cycles.check(tree) == before
