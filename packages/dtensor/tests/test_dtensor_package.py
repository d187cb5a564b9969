"""vescale-dtensor installs as the distribution it declares."""

from vescale.dtensor.testing.packaging import check_component_distribution


def test_dtensor_distribution_is_lockstep_with_exactly_pinned_siblings():
    assert sorted(check_component_distribution("dtensor")) == []


def test_public_names_resolve_and_importing_the_package_alone_registers_nothing():
    import subprocess
    import sys

    # A fresh interpreter: this test process may have loaded the op modules already.
    script = (
        "import sys, vescale.dtensor as d\n"
        "assert 'vescale.dtensor.ops' not in sys.modules, 'importing vescale.dtensor registered strategies'\n"
        "missing = [name for name in d.__all__ if getattr(d, name, None) is None]\n"
        "assert not missing, missing\n"
        "assert 'vescale.dtensor.ops' in sys.modules\n"
        "assert d.distribute_tensor.__module__ == 'vescale.dtensor.placements'\n"
        "assert sorted(d.__all__) == sorted(set(d._LAZY_NAMES) | {'DTensor', 'DTensorError', 'DeviceMesh',"
        " 'MeshError', 'Partial', 'Placement', 'Replicate', 'Shard', '__version__'})\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr


def test_no_submodule_shadows_a_public_name_whatever_is_touched_first():
    """A submodule named like a public function replaces it once anything imports the submodule
    (``vescale.dtensor.redistribute`` was the function, then the module): no name may be both.
    Each lazy name is touched first in a fresh interpreter, with every submodule imported after
    it, and every public name must still be the object its owning module defines."""
    import pkgutil
    import subprocess
    import sys

    import vescale.dtensor as package

    submodules = {info.name for info in pkgutil.iter_modules(package.__path__)}
    assert not submodules & set(package.__all__), sorted(submodules & set(package.__all__))
    script = (
        "import importlib, pkgutil, sys, types, vescale.dtensor as d\n"
        "first = sys.argv[1]\n"
        "getattr(d, first)\n"
        "for info in pkgutil.walk_packages(d.__path__, 'vescale.dtensor.'):\n"
        "    if '.testing' not in info.name: importlib.import_module(info.name)\n"
        "for name, module in d._LAZY_NAMES.items():\n"
        "    value = getattr(d, name)\n"
        "    assert not isinstance(value, types.ModuleType), (first, name)\n"
        "    assert value is getattr(importlib.import_module(module), name), (first, name)\n"
    )
    names = sorted(package._LAZY_NAMES)
    # One interpreter per first-touched name would take ~1 minute; the orders that matter are
    # "a name before its own submodule" and "every submodule before the name", both covered
    # by touching each owning module's names first (one representative per module) and then all.
    representatives = sorted({module: name for name, module in package._LAZY_NAMES.items()}.values())
    for first in [*representatives, names[0]]:
        completed = subprocess.run(
            [sys.executable, "-c", script, first], capture_output=True, text=True, timeout=120
        )
        assert completed.returncode == 0, (first, completed.stderr[-2000:])
