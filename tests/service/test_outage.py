"""The following dispatcher's wait for a database that is down: pure parts (no Ray, no database)."""

from itertools import islice

from packbench.service.dispatcher.rules import OUTAGE_BACKOFF_S, outage_delays
from packbench.service.dispatcher.state import Outage


def test_probes_back_off_to_a_cap_and_never_stop():
    first, cap = OUTAGE_BACKOFF_S
    assert list(islice(outage_delays(first, cap), 7)) == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    # A week of outage at the cap: still probing, never more than one probe per 10 s.
    week = list(islice(outage_delays(first, cap), 7 * 24 * 3600 // 10))
    assert max(week) == cap and week[-1] == cap and sum(week) > 6.99 * 24 * 3600


def test_an_outage_schedules_its_next_probe():
    o = Outage(cause="refused", since=100.0, started_at="00:00:00 UTC", delays=outage_delays(0.5, 2.0))
    assert [o.schedule(100.0) for _ in range(4)] == [0.5, 1.0, 2.0, 2.0] and o.next_probe == 102.0
