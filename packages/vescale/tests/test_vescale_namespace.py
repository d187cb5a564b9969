"""The meta-package owns the ``vescale`` namespace and loads components lazily."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import distribution

import pytest

import vescale
from vescale.dtensor.testing.packaging import check_component_distribution


def _run_python(code: str) -> str:
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return completed.stdout


def test_import_vescale_imports_no_component():
    loaded = _run_python(
        "import json, sys, vescale\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vescale.'))))"
    )
    assert json.loads(loaded) == []


def test_every_component_is_reachable_as_an_attribute_of_vescale():
    for component in vescale.COMPONENTS:
        module = getattr(vescale, component)
        assert module.__name__ == f"vescale.{component}"
        assert module.__version__ == vescale.__version__
    assert set(vescale.COMPONENTS) <= set(dir(vescale))


def test_namespace_path_spans_each_components_own_location():
    # Each component is a separate distribution with its own location (an editable src/
    # directory or a site-packages); extend_path must have gathered them all.
    for component in vescale.COMPONENTS:
        module_file = getattr(vescale, component).__file__
        assert any(module_file.startswith(path) for path in vescale.__path__), (component, vescale.__path__)


def test_unknown_attribute_raises_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'vescale' has no attribute 'paralelize'"):
        vescale.paralelize  # noqa: B018


def test_meta_package_pins_every_component_at_its_own_version():
    requirements = distribution("vescale").requires or []
    pinned = sorted(
        r.split("==")[0].removeprefix("vescale-") for r in requirements if r.startswith("vescale-")
    )
    assert pinned == sorted(vescale.COMPONENTS)
    assert all(r.endswith(f"=={vescale.__version__}") for r in requirements if r.startswith("vescale-"))
    for component in vescale.COMPONENTS:
        check_component_distribution(component)
