"""bench/robustness.py's `NAME+field=value` candidates: what the device script passes through."""

import pytest

from bench.robustness import candidate
from packbench.core.registry import PROFILES


def test_a_candidate_replaces_the_fields_it_names_and_nothing_else():
    """Catches a parser that drops `salient_count` or `outlier_salience`, or reads the scale as the share."""
    c = candidate("opt3+salient=0:8+salient_count=4", PROFILES)
    assert c.salient == (0.0, 8.0) and c.salient_count == 4 and c.rank == PROFILES["opt3"].rank
    assert candidate("opt3+outliers=none", PROFILES).outliers == {}
    c = candidate("opt3+outlier_salience=inputs", PROFILES)
    assert c.outlier_salience == "inputs" and c.salient == PROFILES["opt3"].salient
    assert candidate("opt3", PROFILES) == PROFILES["opt3"]


@pytest.mark.parametrize("spec", ["opt9", "opt3+salient_count=four", "opt3+rank=", "opt3+colour=red",
                                  "opt3+outlier_salience=all"])
def test_a_bad_candidate_names_what_is_wrong(spec):
    with pytest.raises(ValueError) as e:
        candidate(spec, PROFILES)
    assert "opt9" in str(e.value) or "salient_count=N" in str(e.value)
