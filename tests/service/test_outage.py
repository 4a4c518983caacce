"""The following dispatcher's wait for a database that is down (service/dispatcher/outage.py and
rules.py's probe delays): no Ray; the writes it defers run against a real SQLite queue."""

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


def _watch(store=None, *, follow: bool = True):
    from packbench.service.dispatcher.outage import OutageWatch
    from packbench.service.dispatcher.state import State

    said: list[str] = []
    return OutageWatch(State(), store, follow=follow, lease_s=30, backoff=(0.5, 2.0), progress=said.append), said


def _down(cause: str = "connection refused"):
    from packbench.db.errors import DatabaseUnavailable

    return DatabaseUnavailable(cause, failing_s=1.5)


def test_writes_wait_while_the_database_is_down_and_run_in_order_when_it_is_back(store):
    watch, said = _watch(store)
    done: list[str] = []
    watch.when_db(lambda: done.append("before"))  # the database answers: at once
    watch.went_down(_down())
    watch.went_down(_down())  # failed again while catching up: one line only, one more probe counted
    watch.when_db(lambda: done.append("first"))
    watch.when_db(lambda: done.append("second"))
    assert done == ["before"] and len(watch.state.deferred) == 2 and watch.state.outage.probes == 1
    assert len(said) == 1 and said[0].startswith("database unavailable since ")
    watch.came_back(renew=lambda screens: done.append(f"renew {len(screens)}"))
    assert done == ["before", "renew 0", "first", "second"] and watch.state.outage is None
    assert said[-1].startswith("database back after ") and watch.state.waited[0]["probes"] == 1


def test_a_write_the_outage_interrupts_is_kept_only_by_a_following_dispatcher():
    from packbench.db.errors import DatabaseUnavailable

    def fails():
        raise _down()

    for follow, kept in ((True, 1), (False, 0)):
        watch, _ = _watch(follow=follow)
        try:
            watch.when_db(fails)
        except DatabaseUnavailable:
            pass
        assert len(watch.state.deferred) == kept
