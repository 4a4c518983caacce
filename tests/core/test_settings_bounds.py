"""Settings.from_environ (a caller without the CLI) holds the timeouts to the bound the CLI's
`seconds` callback holds the same variables to: one constant, core/settings.py MAX_SECONDS."""

import pytest

from packbench.core.errors import PackbenchError
from packbench.core.settings import MAX_SECONDS, Settings

TIMEOUTS = {"PACKBENCH_PLACEMENT_TIMEOUT_S": "placement_timeout_s", "PACKBENCH_CONNECT_TIMEOUT_S": "connect_timeout_s",
            "PACKBENCH_EPISODE_TIMEOUT_S": "episode_timeout_s", "PACKBENCH_LOAD_TIMEOUT_S": "load_timeout_s"}


@pytest.mark.parametrize("variable", sorted(TIMEOUTS))
def test_a_timeout_beyond_the_cli_s_bound_is_refused_from_the_environment(variable):
    """Catches from_environ taking PACKBENCH_CONNECT_TIMEOUT_S=1e308 (or placement's, or episode's),
    which --connect-timeout refuses: a library caller waited 'forever' where the CLI refused."""
    with pytest.raises(PackbenchError) as e:
        Settings.from_environ({variable: "1e308"})
    assert str(e.value) == (f"{variable}='1e308' is not a number of seconds in (0, {MAX_SECONDS}]; set it to one "
                            f"or unset it")
    assert getattr(Settings.from_environ({variable: str(MAX_SECONDS)}), TIMEOUTS[variable]) == MAX_SECONDS
    with pytest.raises(ValueError, match=f"at most {MAX_SECONDS}$"):
        Settings(**{TIMEOUTS[variable]: 1e308})


def test_the_cli_refuses_by_the_same_bound(packbench_cli):
    from packbench.cli import common

    assert common.MAX_SECONDS is MAX_SECONDS
    r = packbench_cli("--connect-timeout", str(MAX_SECONDS + 1), "keys", "list")
    assert r.returncode == 2 and f"(0, {MAX_SECONDS}]" in r.stderr, r.stderr
