"""Naming a function so that a rank process can find it again.

Rank processes outlive any one test, so a function travels as a reference rather than by
value: its module and qualified name, plus the file to load when the module cannot be
imported by name. Test files collected by pytest with ``--import-mode=importlib`` and the
caller's ``__main__`` script are such modules; a rank loads them from their path, with
pytest's assertion rewriting when pytest is importable, so that a failed ``assert a == b``
on a rank still shows both values. A script's own directory goes first on a rank's
``sys.path``, as Python puts it there for ``python script.py``, so its sibling imports resolve.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["RANK_BODY_ATTRIBUTE", "SCRIPT_MODULE_NAME", "FunctionRef"]

# ``distributed_test`` stores the undecorated test body under this attribute of its wrapper.
RANK_BODY_ATTRIBUTE = "__vescale_rank_body__"
# The name under which ranks load the caller's __main__ script.
SCRIPT_MODULE_NAME = "__vescale_script__"


def _is_test_file(path: str | None) -> bool:
    if not path:
        return False
    name = os.path.basename(path)
    return name.endswith(".py") and (
        name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
    )


@dataclass(frozen=True)
class FunctionRef:
    """Where a module-level function lives: ``module_name``, ``qualname``, and a ``file`` to
    load by path (set for test files, ``None`` for importable modules)."""

    module_name: str
    qualname: str
    file: str | None

    @classmethod
    def of(cls, function: Callable[..., Any]) -> FunctionRef:
        module_name = getattr(function, "__module__", None)
        qualname = getattr(function, "__qualname__", "")
        if module_name is None or "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"{qualname or function!r} cannot run on other ranks: it is a lambda or a nested "
                "function. Define it at module level (rank processes look it up by name)."
            )
        module_file = getattr(sys.modules.get(module_name), "__file__", None)
        if module_name == "__main__":
            if module_file is None:
                raise TypeError(f"{qualname} is defined in an interactive session; define it in a file")
            # Loaded by path under another name, so the script's `if __name__ == "__main__"` stays off.
            return cls(SCRIPT_MODULE_NAME, qualname, module_file)
        return cls(module_name, qualname, module_file if _is_test_file(module_file) else None)

    def resolve(self) -> Callable[..., Any]:
        """Import the module (or load the file) and return the function, unwrapped."""
        target: Any = self._module()
        for part in self.qualname.split("."):
            target = getattr(target, part)
        function: Callable[..., Any] = getattr(target, RANK_BODY_ATTRIBUTE, target)
        return function

    def _module(self) -> ModuleType:
        if self.module_name in sys.modules:
            return sys.modules[self.module_name]
        if self.file is None:
            return importlib.import_module(self.module_name)
        if self.module_name == SCRIPT_MODULE_NAME:
            _put_script_directory_on_path(self.file)
        return _load_test_file(self.module_name, self.file)


def _put_script_directory_on_path(file: str) -> None:
    """Let the script import its neighbours on a rank, as ``python script.py`` lets it in the caller."""
    directory = os.path.dirname(os.path.abspath(file))
    if directory not in sys.path:
        sys.path.insert(0, directory)


def _load_test_file(module_name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load test file {file} as module {module_name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        code = _compile_with_assertion_rewriting(file)
        if code is None:
            spec.loader.exec_module(module)
        else:
            exec(code, module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _compile_with_assertion_rewriting(file: str) -> Any:
    """Compile ``file`` the way pytest would, or return None where pytest is not importable."""
    try:
        import ast

        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return None
    with open(file, "rb") as source_file:
        source = source_file.read()
    tree = ast.parse(source, filename=file)
    rewrite_asserts(tree, source, file, None)
    return compile(tree, file, "exec", dont_inherit=True)
