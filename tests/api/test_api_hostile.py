"""packbench.connect with hostile values, on SQLite and PostgreSQL: what the command line bounds
(typer's min/max) reaches the library unbounded through the API, so the library refuses it in
one PackbenchError naming the argument, stores nothing, never hangs and never raises a driver's
OverflowError or ValueError."""

import math
import re
from pathlib import Path

import pytest
import yaml

import packbench
from packbench.core.errors import PackbenchError
from packbench.db.store import Store
from screens import QUICKSTART, ingest_archive

ROOT = Path(__file__).resolve().parents[2]
HUGE = 10**23


@pytest.fixture
def client(db_url):
    with Store(db_url) as store:
        store.upgrade()
        ingest_archive(store, QUICKSTART, commit="a" * 40, key="1")
    c = packbench.connect(db_url)
    yield c
    c.close()


@pytest.fixture
def protocol_file(tmp_path, tiny) -> Path:
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"] = {"path": str(tiny)}
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("ref", [math.nan, math.inf, -math.inf, 1.5, True, None, [1]],
                         ids=["nan", "inf", "-inf", "1.5", "True", "None", "a-list"])
def test_a_screen_that_is_no_integer_is_one_line(client, ref):
    """nan was a ValueError and inf an OverflowError from int(); True read as screen 1."""
    with pytest.raises(PackbenchError, match=r"give a screen id \(an integer\) or 'latest'"):
        client.screens(screen=ref) if ref is not None else client.label(ref, name="x")


@pytest.mark.parametrize("limit", [HUGE, 2**63, 1e308, math.nan, 0, -1, 2.0, True],
                         ids=["huge", "2**63", "1e308", "nan", "0", "-1", "2.0", "True"])
def test_a_limit_outside_1_to_the_id_range_is_one_line(client, limit):
    """A huge limit was SQLite's OverflowError, nan a ValueError; -1 and 0 returned no rows, silently."""
    with pytest.raises(PackbenchError, match=r"must be an integer from 1 to 2147483647 \(or None for every screen\)"):
        client.screens(limit=limit)
    assert [s.id for s in client.screens(limit=1)] == [1]


@pytest.mark.parametrize("options, fragment", [
    ({"priority": HUGE}, "--priority 100000000000000000000000: give an integer from -2147483648 to 2147483647"),
    ({"priority": 2**31}, "--priority 2147483648: give an integer"),
    ({"priority": math.nan}, "--priority nan: give an integer"),
    ({"priority": 1.0}, "--priority 1.0: give an integer"),
    ({"replicas": 1.0}, "--replicas 1.0: give 1 to 1000"),
    ({"gpu_type": "H\x00"}, "--gpu-type 'H\\x00': give a GPU type of 1-100 printable characters"),
    ({"gpu_type": "H" * 101}, "give a GPU type of 1-100 printable characters"),
    ({"gpu_type": "H200\n"}, "give a GPU type of 1-100 printable characters"),
    ({"note": "n" * 10_001}, "a note of 10001 characters is more than 10000"),
    ({"note": "a\x00b"}, "a note cannot hold a NUL character"),
], ids=["priority-huge", "priority-2**31", "priority-nan", "priority-float", "replicas-float", "gpu-nul",
        "gpu-huge", "gpu-newline", "note-huge", "note-nul"])
def test_submit_refuses_what_the_screens_table_cannot_hold_and_queues_nothing(client, protocol_file, options,
                                                                              fragment):
    """Each was an OverflowError, a NOT NULL 'packbench bug' (nan), a NUL stored on SQLite (and a
    PostgreSQL error), or a 16 MB note stored and echoed by `screens tag`."""
    with pytest.raises(PackbenchError) as caught:
        client.submit(protocol_file, **options)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    assert [s.id for s in client.screens()] == [1]  # nothing queued
    assert client.submit(protocol_file, priority=-2**31, gpu_type="H200", note="n" * 10_000) == [2]  # the bounds hold


def test_a_note_set_later_is_bounded_as_at_submit(client):
    with pytest.raises(PackbenchError, match="a note of 10001 characters is more than 10000"):
        client.label(1, note="n" * 10_001)
    assert client.screens(screen=1)[0].note is None


@pytest.mark.parametrize("options, fragment", [
    ({"timeout_s": math.nan}, "timeout_s=nan: give a finite number of seconds >= 0"),
    ({"timeout_s": -1}, "timeout_s=-1: give a finite number of seconds >= 0"),
    ({"timeout_s": math.inf}, "timeout_s=inf: give a finite number"),
    ({"poll_s": 0}, "poll_s=0: give a finite number of seconds > 0"),
    ({"poll_s": -1}, "poll_s=-1: give a finite number of seconds > 0"),
    ({"poll_s": math.nan}, "poll_s=nan: give a finite number of seconds > 0"),
    ({"poll_s": math.inf}, "poll_s=inf: give a finite number of seconds > 0"),
], ids=["timeout-nan", "timeout-negative", "timeout-inf", "poll-0", "poll-negative", "poll-nan", "poll-inf"])
def test_wait_refuses_times_it_cannot_keep(client, options, fragment):
    """timeout nan waited forever; poll -1 and nan were time.sleep's ValueError; poll inf slept forever."""
    queued = client.store.create_screen(protocol_id=1, submitter="t")

    def sleep(seconds):  # the value was taken: without the check, nan and inf never return
        raise AssertionError(f"slept {seconds} s")

    with pytest.raises(PackbenchError, match=fragment.replace("(", r"\(")):
        client.wait(queued, sleep=sleep, **options)


def test_wait_never_sleeps_past_its_timeout(client):
    queued = client.store.create_screen(protocol_id=1, submitter="t")
    slept = []
    with pytest.raises(TimeoutError, match="still queued after 0.05 s"):
        client.wait(queued, timeout_s=0.05, poll_s=3600, sleep=lambda s: (slept.append(s), __import__("time").sleep(s)))
    assert slept and max(slept) <= 0.05  # a poll of an hour was slept whole, past the timeout


@pytest.mark.parametrize("workers", [0, -1, 1025, 1.5, True], ids=["0", "-1", "1025", "1.5", "True"])
def test_run_refuses_a_worker_count_before_anything_starts(client, workers):
    """workers=-1 ran nothing and returned [] with screens queued; 0 meant 'one per GPU'."""
    with pytest.raises(PackbenchError, match=r"give an integer from 1 to 1024, or None"):
        client.run(workers=workers)


def test_run_of_a_screen_that_does_not_exist_starts_no_pool(client, monkeypatch):
    """run(screen=10**23) started Ray (15 s here) before finding out there is no such screen."""
    import sys
    from types import SimpleNamespace

    def connect():
        raise AssertionError("a pool was started for a screen that does not exist")

    monkeypatch.setitem(sys.modules, "packbench.cluster.pool",
                        SimpleNamespace(RayPool=lambda settings: SimpleNamespace(connect=connect)))
    for screen in (HUGE, 99):
        with pytest.raises(PackbenchError, match=f"no screen with id {screen}"):
            client.run(screen=screen)


def test_untag_given_one_string_is_refused_and_changes_nothing(client):
    """untag='team' was read as set('team'): it dropped tags t, e, a and m and kept team."""
    client.label(1, tags={"team": "infra", "t": "x", "a": "y"})
    with pytest.raises(PackbenchError, match=r"untag='team': give the tag keys to drop as a list"):
        client.label(1, name="renamed", untag="team")
    for untag, fragment in (([None], "tag key None is not text"), (5, "untag=5: give the tag keys")):
        with pytest.raises(PackbenchError, match=fragment):
            client.label(1, untag=untag)
    assert client.store.screen_tags([1])[1] == {"a": "y", "t": "x", "team": "infra"}
    assert client.screens(screen=1)[0].name is None  # the refused call's name was not kept either
    client.label(1, untag=("team",))
    assert client.store.screen_tags([1])[1] == {"a": "y", "t": "x"}


@pytest.mark.parametrize("tags, fragment", [
    (["team=infra"], "tags are a mapping of key to value"), ("team=infra", "tags are a mapping of key to value"),
    ({"team": None}, "tag team: its value is text or a number, not NoneType; to drop the tag, untag it"),
    ({"team": ["a"]}, "tag team: its value is text or a number, not list"),
], ids=["list", "str", "None", "a-list-value"])
def test_tags_that_are_no_mapping_of_text_are_one_line(client, protocol_file, tags, fragment):
    """A list or a string was an AttributeError ('no attribute items') from deep in db/labels.py;
    a value None was stored as the text 'None' and a list as "['a']"."""
    for call in (lambda: client.label(1, tags=tags), lambda: client.screens(tags=tags),
                 lambda: client.episodes(tags=tags), lambda: client.submit(protocol_file, tags=tags)):
        with pytest.raises(PackbenchError, match=re.escape(fragment)):
            call()
    assert client.store.screen_tags([1])[1] == {} and [s.id for s in client.screens()] == [1]
    client.label(1, tags={"run": 3})  # a number is written as text, as before
    assert client.screens(tags={"run": "3"})[0].id == 1


@pytest.mark.parametrize("select, fragment", [
    ({"protocol": 5}, "protocol 5: give a protocol name or SHA-256 prefix as text"),
    ({"protocol": ["quickstart"]}, "protocol ['quickstart']: give a protocol name"),
    ({"name": ["x"]}, "name=['x']: give a name as text"), ({"sweep": 5}, "sweep=5: give a sweep as text"),
], ids=["protocol-int", "protocol-list", "name-list", "sweep-int"])
def test_a_filter_that_is_no_text_is_one_line(client, select, fragment):
    """protocol=5 was an AttributeError ('int' has no 'lower'); name=['x'] reached the driver and
    was reported as a 'database error' with advice to check the database."""
    with pytest.raises(PackbenchError, match=re.escape(fragment)):
        client.screens(**select)


@pytest.mark.parametrize("call, fragment", [
    (lambda c: c.episodes(role="score"), "unknown role 'score'; use one of scored, warmup"),
    (lambda c: c.verdicts(gate="faithful"), "unknown gate 'faithful'; use one of faithfulness"),
], ids=["role", "gate"])
def test_an_unknown_role_or_gate_is_refused_not_an_empty_listing(client, call, fragment):
    """episodes(role='score') and verdicts(gate='faithful') returned no rows, as if the screen had
    none, where `results --role/--gate` refuses the typo with the names it knows."""
    with pytest.raises(PackbenchError, match=re.escape(fragment)):
        call(client)
    assert {e.role for e in client.episodes()} == {"scored", "warmup"} and client.verdicts(gate="faithfulness")


def test_history_of_a_protocol_that_is_no_text_is_one_line(client):
    """history(None) was an AttributeError from the SQL layer."""
    for protocol in (None, 5):
        with pytest.raises(PackbenchError, match="give a protocol name or SHA-256 prefix as text"):
            client.history(protocol)


@pytest.mark.parametrize("pct", [math.nan, -1, "10", None, True], ids=["nan", "-1", "str", "None", "True"])
def test_regressions_refuse_a_percentage_they_cannot_judge(client, pct):
    """regressions(nan) compared every step with NaN, found none and returned []: a CI gate that
    passes whatever happened (the command line refuses nan, the API did not); '10' and None
    were a TypeError only when a step existed."""
    history = client.history(client.store.protocol(client.screens(screen=1)[0].protocol_id).name)
    with pytest.raises(PackbenchError, match="give a percentage >= 0"):
        history.regressions(pct)
    from packbench.service.history import compare_regressions

    with pytest.raises(PackbenchError, match="give a percentage >= 0"):
        compare_regressions(client.store, 1, 1, pct)


def test_sweep_latest_is_the_newest_sweep_as_on_the_command_line(client, protocol_file):
    """Bug caught: `db.screens(sweep="latest")` matched no sweep id and returned an empty listing,
    where `results --sweep latest` reads the newest sweep; with no sweep at all it is one line."""
    with pytest.raises(PackbenchError, match="there is no sweep yet"):
        client.screens(sweep="latest")
    (first,) = client.submit(protocol_file)
    (second,) = client.submit(protocol_file)
    client.store.set_sweep(first, sweep_id="s-old", point={"allowance_mib": 1})
    client.store.set_sweep(second, sweep_id="s-new", point={"allowance_mib": 2})
    assert [s.id for s in client.screens(sweep="latest")] == [second]
    assert [s.id for s in client.screens(sweep="s-old")] == [first]
