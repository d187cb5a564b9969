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
