"""Whether a dispatcher holding screens still runs on this host (service/dispatcher/holders.py),
with real processes, and what a new `dispatch` does with the screens such holders keep."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timedelta, timezone

from packbench.service.dispatcher.holders import holder_alive
from packbench.service.submit import submit
from tests.service.fake_pool import FakePool
from tests.service.screens import dispatcher, gone_pid, protocol_file


def test_a_running_process_lives_an_ended_one_does_not_nor_a_later_one_with_its_pid():
    now = datetime.now(timezone.utc)
    assert holder_alive(os.getpid(), now)
    assert not holder_alive(gone_pid(), now)
    # This process started after that registration: a pid the system gave again is not the holder.
    assert not holder_alive(os.getpid(), now - timedelta(days=3650))


def test_a_new_dispatch_spares_a_live_holder_here_and_runs_a_dead_ones_screen_at_once(store, tmp_path):
    kept, freed = submit(store, protocol_file(tmp_path), replicas=2)
    host = platform.node()
    # A `dispatch --follow` of this host, alive (this very process), its lease run out in an outage ...
    live = store.register_dispatcher("follow", host, pid=os.getpid())
    store.claim_screen(live, lease_s=0.001, archive_dir=str(tmp_path), source_freeze={}, screen_id=kept)
    # ... and a driver killed a moment ago, its lease still 10 minutes long.
    dead = store.register_dispatcher("killed", host, pid=gone_pid())
    store.claim_screen(dead, lease_s=600, archive_dir=str(tmp_path), source_freeze={}, screen_id=freed)
    outcomes = dispatcher(store, tmp_path, FakePool(), workers=1).run()
    assert [(o.screen_id, o.status) for o in outcomes] == [(freed, "done")]
    assert [a.status for a in store.attempts(freed)] == ["lost", "done"]
    (attempt,) = store.attempts(kept)
    assert attempt.status == "running"  # still the live holder's: nothing thrown away
