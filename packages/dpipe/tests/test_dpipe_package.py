"""vescale-dpipe installs as the distribution it declares."""

from vescale.dtensor.testing.packaging import check_component_distribution


def test_dpipe_distribution_is_lockstep_with_exactly_pinned_siblings():
    assert sorted(check_component_distribution("dpipe")) == ["dmodule", "doptim", "dtensor"]
