"""vescale-doptim installs as the distribution it declares."""

from vescale.dtensor.testing.packaging import check_component_distribution


def test_doptim_distribution_is_lockstep_with_exactly_pinned_siblings():
    assert sorted(check_component_distribution("doptim")) == ["dtensor"]
