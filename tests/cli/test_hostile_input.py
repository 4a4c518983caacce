"""Hostile input: every case a one-line error naming the cause and the limit or fix, exit 2, no
traceback, nothing queued or lost; names from a protocol printed escaped.

Commands run in this process through the console entry point (`packbench.cli.main.main`), so a case
costs milliseconds, and an uncaught exception fails the test with its traceback.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    code: int
    out: str
    err: str


def pb(capsys, *args: str) -> Result:
    from packbench.cli.main import main

    argv, sys.argv = sys.argv, ["packbench", *args]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def one_line_error(r: Result, *fragments: str) -> str:
    assert r.code == 2, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.err
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def db(tmp_path, monkeypatch) -> str:
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    monkeypatch.setenv("PACKBENCH_DB_URL", url)
    monkeypatch.chdir(tmp_path)
    from packbench.db.store import Store

    with Store(url) as store:
        store.upgrade()
    return url


def queued(url: str) -> list:
    from packbench.db.store import Store

    with Store(url) as store:
        return store.list_screens()


def quickstart(tiny: Path, **changes) -> dict:
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"]["path"] = str(tiny)
    body.update(changes)
    return body


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# ----------------------------------------------------------------------------- the protocol reader


@pytest.mark.parametrize("command", ["submit", "validate"])
def test_a_protocol_that_is_not_utf8_is_one_line(tmp_path, db, tiny, capsys, command):
    p = write(tmp_path / "p.yaml", b"name: q\xff\xfe\n" + yaml.safe_dump(quickstart(tiny)).encode())
    args = ["submit", str(p)] if command == "submit" else ["protocol", "validate", str(p)]
    one_line_error(pb(capsys, *args), "is not UTF-8 text", "byte 0xff at offset 7", "save it as UTF-8")
    assert queued(db) == []


def test_an_integer_of_5001_digits_names_the_digit_limit(tmp_path, db, tiny, capsys):
    text = yaml.safe_dump(quickstart(tiny, allowance_mib=4800)).replace("4800", "9" * 5001)
    r = pb(capsys, "submit", str(write(tmp_path / "p.yaml", text)))
    one_line_error(r, "5001 characters", "at most 100 digits")
    assert queued(db) == []


def test_a_list_nested_5000_deep_names_the_depth_limit(tmp_path, db, tiny, capsys):
    text = yaml.safe_dump(quickstart(tiny)) + "extra: " + "[" * 5000 + "]" * 5000 + "\n"
    r = pb(capsys, "protocol", "validate", str(write(tmp_path / "p.yaml", text)))
    one_line_error(r, "nest deeper than 32 levels, the limit")


def _alias_bomb(levels: int, width: int) -> str:
    """A flow list of anchors, each `width` aliases of the previous: width**levels values."""
    anchors, prev = ["&a0 [" + ", ".join(["x"] * width) + "]"], "a0"
    for i in range(1, levels):
        anchors.append(f"&a{i} [" + ", ".join([f"*{prev}"] * width) + "]")
        prev = f"a{i}"
    return "[" + ", ".join(anchors) + "]"


def test_an_alias_bomb_under_gates_resources_is_refused_fast_and_small(tmp_path, db, tiny, capsys):
    """9**9 values from ~1 KB: refused by the reader's expansion limit, not expanded by a message."""
    text = yaml.safe_dump(quickstart(tiny)).replace("gates:\n", f"gates:\n  resources: {_alias_bomb(9, 9)}\n")
    assert len(text) < 2000
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    r = pb(capsys, "submit", str(write(tmp_path / "p.yaml", text)))
    assert time.monotonic() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 100_000  # KiB: no expansion
    one_line_error(r, "expands to more than 4194304 values, the limit", "aliases")
    assert queued(db) == []


def test_an_alias_bomb_below_the_limit_is_shown_cut_not_rendered(tmp_path, db, tiny, capsys):
    """8**7 = 2M values pass the reader; the message shows 60 characters of them."""
    text = yaml.safe_dump(quickstart(tiny)).replace("gates:\n", f"gates:\n  resources: {_alias_bomb(7, 8)}\n")
    t0 = time.monotonic()
    line = one_line_error(pb(capsys, "submit", str(write(tmp_path / "p.yaml", text))),
                          "`gates.resources`: expected a mapping, got [[")
    assert time.monotonic() - t0 < 5 and len(line) < 200


def test_values_shown_in_messages_are_bounded():
    from packbench.core.protocol.fields import shown as _show
    from packbench.core.registry import _show as registry_show

    a: list = ["x"] * 9
    for _ in range(9):
        a = [a] * 9  # 9**10 leaves, shared
    for show in (_show, registry_show):
        t0 = time.monotonic()
        assert len(show(a)) == 60 and show(a).endswith("...")
        assert "5001 digits" in show(10 ** 5000)  # repr() itself refuses past 4300 digits
        assert show("\u202e\n") == repr("\u202e\n")
        assert time.monotonic() - t0 < 0.1


def test_a_protocol_over_the_size_limit_names_it(tmp_path, db, monkeypatch, capsys):
    import importlib

    monkeypatch.setattr(importlib.import_module("packbench.core.protocol.freeze"), "MAX_PROTOCOL_BYTES", 1 << 20)
    p = write(tmp_path / "p.yaml", "name: q\n" + "#" * (1 << 20) + "\n")
    one_line_error(pb(capsys, "protocol", "validate", str(p)), "is 1048585 bytes",
                   "a protocol file is at most 1 MiB", "prompts.token_file")


def test_a_key_with_a_newline_stays_one_line(tmp_path, db, capsys):
    p = write(tmp_path / "p.yaml", 'name: q\n"colour\\n\\u202eblue": 1\n')
    one_line_error(pb(capsys, "protocol", "validate", str(p)), "`colour\\n\\u202eblue`: unknown field")


# ----------------------------------------------------------------------------- file arguments


def test_report_out_in_a_missing_directory_is_one_line(tmp_path, db, capsys):
    r = pb(capsys, "report", "1", "--out", str(tmp_path / "nonexistent" / "dir" / "x.html"))
    one_line_error(r, "the directory", "does not exist", "create it or choose another --out")


@pytest.mark.parametrize("where", ["/proc/x", "a-file", "a-file/sub"])
def test_model_synth_out_that_cannot_be_a_directory_is_one_line(tmp_path, db, capsys, where):
    (tmp_path / "a-file").write_text("not a directory")
    out = where if where.startswith("/") else str(tmp_path / where)
    r = pb(capsys, "model", "synth", "--out", out)
    one_line_error(r, f"--out {out}: cannot create that directory", "give --out a writable directory")


def test_write_output_leaves_no_partial_file(tmp_path):
    from packbench.cli.common import write_output
    from packbench.core.errors import PackbenchError

    (tmp_path / "x.html").mkdir()  # a directory where the file goes: the final rename fails
    with pytest.raises(PackbenchError, match="--out .*x.html: cannot write it"):
        write_output(tmp_path / "x.html", "<html>", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.html"]  # no .x.html.tmp left behind
    write_output(tmp_path / "ok.html", "<html>", "--out")
    assert (tmp_path / "ok.html").read_text() == "<html>"


def test_keys_init_where_no_key_can_be_written_is_one_line(tmp_path, db, capsys):
    r = pb(capsys, "keys", "init", "--key", "/proc/x/key.pem", "--no-db")
    one_line_error(r, "--key /proc/x/key.pem: cannot write the key there")


@pytest.mark.parametrize("existing", ["k.pem", "k.pem.pub"])
def test_keys_init_names_the_key_file_already_there_and_keeps_it(tmp_path, db, capsys, existing):
    """With only k.pem.pub there (another lab's public key, say), `keys init --key k.pem` said
    'a key already exists at k.pem', a file that was not there: the line names the one that is."""
    (tmp_path / existing).write_text("kept")
    r = pb(capsys, "keys", "init", "--key", str(tmp_path / "k.pem"), "--no-db")
    assert one_line_error(r) == (f"error: a key already exists at {tmp_path / existing}; keys are never overwritten "
                                 f"(choose another --key)")
    assert [p.name for p in tmp_path.glob("k.pem*")] == [existing] and (tmp_path / existing).read_text() == "kept"


@pytest.mark.parametrize("name", ["evil\nname", "\x1b[2J", "", "a" * 100_000])
def test_a_key_name_that_is_not_one_short_line_is_refused_before_any_key_is_written(tmp_path, db, capsys, name):
    """Catches `keys init --name` / `keys register --name` storing any text: a newline split every
    later `keys list` row in two, an escape reached the terminal, a 100,000-character name was kept."""
    one_line_error(pb(capsys, "keys", "init", "--key", str(tmp_path / "k.pem"), "--name", name),
                   "--name", "must be one line of 1-200 printable characters")
    assert list(tmp_path.glob("k.pem*")) == []
    assert pb(capsys, "keys", "init", "--key", str(tmp_path / "k.pem"), "--name", "lab").code == 0
    one_line_error(pb(capsys, "keys", "register", str(tmp_path / "k.pem.pub"), "--name", name), "--name")
    r = pb(capsys, "keys", "list")
    assert r.code == 0 and r.out.count("\n") == 1 and r.out.rstrip().endswith("lab"), r.out


def test_an_archive_dir_that_cannot_be_created_queues_nothing(tmp_path, db, tiny, capsys):
    (tmp_path / "a-file").write_text("not a directory")
    p = write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny)))
    r = pb(capsys, "submit", str(p), "--wait", "--archive-dir", str(tmp_path / "a-file" / "archives"))
    one_line_error(r, "--archive-dir", "cannot create that directory")
    assert queued(db) == []
    # dispatch: refused before Ray starts or anything is claimed; the queued screen stays queued.
    assert pb(capsys, "submit", str(p)).code == 0
    r = pb(capsys, "dispatch", "--archive-dir", str(tmp_path / "a-file" / "archives"))
    one_line_error(r, "--archive-dir", "cannot create that directory")  # the words submit --wait uses
    assert [s.status for s in queued(db)] == ["queued"]


# ----------------------------------------------------------------------------- words


def test_a_config_json_that_is_not_json_names_the_checkpoint_file(tmp_path, db, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    body = quickstart(model)
    line = one_line_error(pb(capsys, "submit", str(write(tmp_path / "p.yaml", yaml.safe_dump(body)))),
                          f"{model / 'config.json'} is not JSON")
    assert "prompts" not in line
    assert queued(db) == []


HOSTILE_NAME = "../../../etc/passwd\u202e\u03c0\n"


def test_a_hostile_protocol_name_is_printed_escaped(tmp_path, db, tiny, capsys):
    p = write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny, name=HOSTILE_NAME)))
    assert pb(capsys, "submit", str(p)).code == 0
    r = pb(capsys, "screens", "list")
    assert r.code == 0
    rows = r.out.strip().splitlines()
    assert len(rows) == 2 and "\u202e" not in r.out, r.out  # the header and one row, not split
    assert "../../../etc/passwd\\u202e\u03c0\\n" in rows[1]
    r = pb(capsys, "screens", "show", "1")
    assert "\u202e" not in r.out and r.out.splitlines()[0].startswith("screen 1: ../../../etc/passwd\\u202e")
    r = pb(capsys, "status")
    assert "\u202e" not in r.out
    r = pb(capsys, "screens", "list", "--json")  # JSON escapes it too, and keeps the name
    import json

    assert json.loads(r.out)[0]["protocol"] == HOSTILE_NAME and "\u202e" not in r.out


def test_address_without_wait_is_refused_and_queues_nothing(tmp_path, db, tiny, capsys, monkeypatch):
    p = write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny)))
    r = pb(capsys, "submit", str(p), "--address", "127.0.0.1:1")
    one_line_error(r, "--address 127.0.0.1:1", "without --wait", "add --wait", "packbench dispatch --address")
    assert queued(db) == []
    # PACKBENCH_RAY_ADDRESS is every command's setting, not something this submit was told.
    monkeypatch.setenv("PACKBENCH_RAY_ADDRESS", "127.0.0.1:1")
    assert pb(capsys, "submit", str(p)).code == 0 and len(queued(db)) == 1


def test_archive_dir_without_wait_is_refused_and_queues_nothing(tmp_path, db, tiny, capsys, monkeypatch):
    # Catches a submit that queued the screen and dropped --archive-dir: the dispatcher wrote the
    # archive under its own folder, and the user looked for it where they had asked.
    p = write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny)))
    r = pb(capsys, "submit", str(p), "--archive-dir", str(tmp_path / "mine"))
    one_line_error(r, "--archive-dir", "without --wait", "add --wait", "packbench dispatch --archive-dir")
    assert queued(db) == [] and not (tmp_path / "mine").exists()
    # PACKBENCH_ARCHIVE_DIR is every command's setting, not something this submit was told.
    monkeypatch.setenv("PACKBENCH_ARCHIVE_DIR", str(tmp_path / "env"))
    assert pb(capsys, "submit", str(p)).code == 0 and len(queued(db)) == 1


# ----------------------------------------------------------------------------- attempts


def _claimed(url: str, tiny: Path, tmp_path: Path, *, max_attempts: int = 3):
    """A submitted quickstart screen, claimed: (store, claim, ScreenRun)."""
    from packbench.db.store import Store
    from packbench.service.screen import ScreenRun
    from packbench.service.submit import submit

    store = Store(url)
    p = write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny)))
    if not store.list_screens():
        submit(store, p, max_attempts=max_attempts)
    dispatcher = store.register_dispatcher("d", "h")
    claim = store.claim_screen(dispatcher, lease_s=60, archive_dir=str(tmp_path / "archives"), source_freeze={})
    run = ScreenRun(store, screen=claim.screen, attempt=claim.attempt, protocol=json.loads(claim.protocol.canonical_json),
                    archive_path=Path(claim.attempt.archive_path), freeze={})
    return store, claim, run


def test_a_killed_worker_is_reported_as_the_attempt_failing_and_what_comes_next(tmp_path, db, tiny, capsys,
                                                                                monkeypatch):
    """Attempt 1's worker died: the attempt failed, the screen is queued for attempt 2, which is
    done: no `screen 1 failed`, and exit 0."""
    store, claim, run = _claimed(db, tiny, tmp_path)
    run.begin({"device": "cpu"})
    died = run.fail("failed", "worker w0 (pid 7, node ab12) died: RayActorError: killed", requeue=True)
    assert died.requeued and died.attempt_number == 1 and died.screen_status == "queued"
    _, _, second = _claimed(db, tiny, tmp_path)
    done = second.fail("failed", "worker w0b died", requeue=True)  # stands in for attempt 2's own end
    import dataclasses

    done = dataclasses.replace(done, status="done", screen_status="done")
    _fake_dispatcher(monkeypatch, [died, done])
    r = pb(capsys, "dispatch")
    assert ("attempt 1 failed: worker w0 (pid 7, node ab12) died: RayActorError: killed; screen 1 queued for "
            "attempt 2 (partial archive kept: ") in r.err, r.err
    assert "screen 1 failed" not in r.err + r.out and "screen 1: done" in r.out
    assert r.code == 0
    # The last attempt's death is the screen's failure, said as before, exit 1.
    store, claim, third = _claimed(db, tiny, tmp_path)  # attempt 3 of 3
    last = third.fail("failed", "worker w1 died", requeue=True)
    assert not last.requeued and last.screen_status == "failed"
    _fake_dispatcher(monkeypatch, [last])
    r = pb(capsys, "dispatch")
    assert "error: screen 1 failed: worker w1 died" in r.err and r.code == 1


def _fake_dispatcher(monkeypatch, outcomes) -> None:
    import packbench.service.dispatcher

    class Fake:
        fatal = stopping = None
        refusals, slots, held = [], [], []

        def __init__(self, store, settings, pool, *, on_outcome, **options) -> None:
            self.on_outcome = on_outcome

        def run(self):
            for o in outcomes:
                self.on_outcome(o)
            return outcomes

    monkeypatch.setattr(packbench.service.dispatcher, "Dispatcher", Fake)


def test_audit_all_reports_unfinished_attempts_without_failing(tmp_path, db, tiny, capsys):
    """A failed attempt with no archive, one with an empty file (left by an older packbench),
    and one with a partial archive: each said, and `audit --all` still exits 0."""
    from packbench.service.submit import submit

    store, _, run = _claimed(db, tiny, tmp_path)  # screen 1: failed before its archive existed
    run.fail("failed", "could not create archive (No space left on device)")
    p = tmp_path / "p.yaml"
    submit(store, p)
    _, c2, run2 = _claimed(db, tiny, tmp_path)  # screen 2: an empty file
    Path(c2.attempt.archive_path).parent.mkdir(parents=True, exist_ok=True)
    Path(c2.attempt.archive_path).write_bytes(b"")
    run2.fail("failed", "disk full")
    submit(store, p)
    _, _, run3 = _claimed(db, tiny, tmp_path)  # screen 3: protocol.json written, then the worker failed
    run3.begin({"device": "cpu"})
    run3.fail("failed", "RuntimeError: boom")
    r = pb(capsys, "audit", "--all")
    lines = r.out.strip().splitlines()
    assert lines[0].startswith("audit of screen 1: NO ARCHIVE (attempt 1 failed and left no archive at ")
    assert lines[1].startswith("audit of screen 2: NO ARCHIVE (attempt 1 failed and left an empty archive file")
    assert lines[2].startswith("audit of screen 3: PARTIAL (attempt 1 failed: 0 of 8 planned episodes archived")
    assert r.code == 0, (r.out, r.err)
    r = pb(capsys, "audit", "--all", "--json")  # the same, as JSON Lines
    assert [json.loads(line)["result"] for line in r.out.splitlines()] == ["no-archive", "no-archive", "partial"]
    # The database keeps what was printed: the partial archive's audits are `partial`, not `disagree`.
    assert [u.result for u in store.audits(store.latest_attempt(3).id)] == ["partial", "partial"]
    r = pb(capsys, "results", "--screen", "3")
    assert "audit: PARTIAL (" in r.out and "partial archive (no SHA-256 stored); 2 audit(s))" in r.out, r.out
    r = pb(capsys, "report", "3", "--out", str(tmp_path / "r.html"))
    assert r.code == 0, (r.out, r.err)
    page = (tmp_path / "r.html").read_text()
    assert "Audits recorded in" in page, page[page.find("audit"):][:3000]
    audits = page.split("Audits recorded in", 1)[1].split("</table>", 1)[0]
    assert audits.count(">PARTIAL<") == 2 and "DISAGREE" not in audits


def _screen_held_by_a_dead_dispatcher(tmp_path, db, tiny):
    """A queued screen claimed by a dispatcher registered on this host with a pid that is no
    process now (a driver killed with SIGKILL); returns the store and that pid."""
    import platform
    import subprocess

    from packbench.db.store import Store
    from packbench.service.submit import submit

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no process now
    store = Store(db)
    submit(store, write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny))))
    dead = store.register_dispatcher(f"dispatch-{platform.node()}-{gone.pid}", platform.node(), pid=gone.pid)
    store.claim_screen(dead, lease_s=60, archive_dir=str(tmp_path / "archives"), source_freeze={})
    return store, gone.pid


def test_dispatch_takes_a_dead_dispatchers_screen_at_once(tmp_path, db, tiny, capsys):
    """A driver killed with SIGKILL held its screen for its whole 60 s lease although `dispatch`
    already said that its process was gone: on its own host it now loses the lease at once."""
    import platform

    store, pid = _screen_held_by_a_dead_dispatcher(tmp_path, db, tiny)
    r = pb(capsys, "dispatch")
    assert r.code == 0, (r.out, r.err)
    assert (f"screen 1: attempt 1 lost (its dispatcher (pid {pid} on {platform.node()}) is gone), screen "
            f"queued") in r.out + r.err
    assert [a.status for a in store.attempts(1)] == ["lost", "done"]


def test_cancelling_a_dead_dispatchers_screen_names_what_ends_it(tmp_path, db, tiny, capsys):
    """Bug caught: `screens cancel` of a screen whose driver was SIGKILLed said it "stops after the
    episode in flight, once its dispatcher renews its lease"; a dead dispatcher never renews, and
    the screen stayed running with nothing said about `packbench dispatch`, which ends it."""
    import platform

    store, pid = _screen_held_by_a_dead_dispatcher(tmp_path, db, tiny)
    r = pb(capsys, "screens", "cancel", "1")
    assert r.code == 0 and r.err == "", (r.out, r.err)
    assert r.out == (f"screen 1 is running under dispatcher dispatch-{platform.node()}-{pid}, whose process "
                     f"(pid {pid} on this host) is gone: `packbench dispatch` marks its attempt lost and the "
                     f"screen cancelled\n")

    from packbench.service.dispatcher.holders import holder_alive

    (reaped,) = store.reap_expired(host=platform.node(), alive=holder_alive)  # what `dispatch` does first
    assert (reaped.screen_status, reaped.attempt_number) == ("cancelled", 1)
    assert [a.status for a in store.attempts(1)] == ["lost"] and store.screen(1).status == "cancelled"


def test_a_silent_dispatcher_on_another_host_is_named_a_live_one_is_not():
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from packbench.service.dispatcher.rules import held_by_silent

    now = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    running = [SimpleNamespace(screen_id=i, attempt=1, dispatcher=f"d{i}", lease_expires_at=now + timedelta(seconds=40))
               for i in (1, 2)]
    dispatchers = [SimpleNamespace(name="d1", host="elsewhere", pid=5, heartbeat_at=now - timedelta(seconds=20)),
                   SimpleNamespace(name="d2", host="elsewhere", pid=6, heartbeat_at=now - timedelta(seconds=1))]
    status = SimpleNamespace(now=now, running=running, dispatchers=dispatchers)
    (line,) = held_by_silent(status, host="here", alive=lambda pid: True)
    assert line.startswith("screen 1 is held by dispatcher d1 (no heartbeat for 20 s): attempt 1's lease expires "
                           "at 2026-12-01T12:00:40+00:00 (in 40 s)")


def test_status_says_a_killed_dispatcher_is_not_live_at_once():
    """Item 9: a SIGKILLed dispatcher's heartbeat is still fresh, but on its own host its
    process is gone: `status` says so instead of listing it live for its heartbeat window."""
    import platform
    import subprocess
    import sys
    from types import SimpleNamespace

    import os

    from packbench.cli.query import _liveness

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = platform.node()
    assert _liveness(SimpleNamespace(host=here, pid=gone.pid, live=True)) == "NO (its process is gone)"
    assert _liveness(SimpleNamespace(host=here, pid=os.getpid(), live=True)) == "yes"
    assert _liveness(SimpleNamespace(host="elsewhere", pid=gone.pid, live=False)) == "NO (no heartbeat)"


def test_an_empty_screen_reference_is_refused_not_read_as_latest(tmp_path, db, tiny, capsys):
    """Catches `results --screen ''` (an unset variable in a script) showing the latest screen with
    exit 0 (`screen or "latest"`), and `report ''` taking '' for the current directory
    ("error:  is a directory, not an archive file")."""
    assert pb(capsys, "submit", str(write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny))))).code == 0
    one_line_error(pb(capsys, "results", "--screen", ""), "no screen ''")
    one_line_error(pb(capsys, "report", "", "--out", str(tmp_path / "r.html")), "''", "an id or `latest`")
    assert not (tmp_path / "r.html").exists() and [s.status for s in queued(db)] == ["queued"]


def test_an_error_quoting_input_with_a_newline_stays_one_line(tmp_path, db, capsys):
    """Catches `packbench history $'\\n...'` printing two lines: its hint quoted the protocol raw
    (`screens list --protocol <newline>`). Every PackbenchError line is now escaped where it is printed."""
    line = one_line_error(pb(capsys, "history", "q\n\x1b[31m"), "no done screen of protocol")
    assert "\x1b" not in line and "--protocol q\\n\\x1b[31m" in line


MEGABYTE = "x" * (1 << 20)


@pytest.mark.parametrize("args, start, end", [
    (["results", "--tag", MEGABYTE], "error: --tag 'xxx", "' is not KEY=VALUE; write e.g. --tag team=infra"),
    (["results", "--format", MEGABYTE], "error: unknown --format 'xxx", "'; use one of table, json, csv"),
    (["screens", "list", "--status", MEGABYTE], "error: unknown screen status 'xxx", "use one of queued, running, done, "
                                                                                "failed, cancelled"),
    (["report", "--sweep", MEGABYTE], "error: no sweep 'xxx", "`packbench screens list` shows each screen's sweep"),
    (["submit", "p.yaml", "--sweep", MEGABYTE], "error: --sweep 'xxx", "write e.g. --sweep prefix_tokens=32,64"),
    (["--worker-threads", MEGABYTE, "status"], "error: ", ""),
    ([MEGABYTE], "error: No such command 'xxx", "'; see `packbench --help`"),
    (["status", "--" + MEGABYTE], "error: No such option: --xxx", "; see `packbench status --help`"),
])
def test_an_error_quoting_a_megabyte_of_input_is_a_bounded_line_with_its_cause_and_fix(tmp_path, db, tiny, capsys,
                                                                                       args, start, end):
    """Each of these printed the megabyte value whole: a 1,048,6xx-character error line, its fix
    a megabyte away from its cause. The line printed keeps both ends and says how much was cut."""
    from packbench.core.text import ERROR_LINE_LIMIT

    write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny)))
    line = one_line_error(pb(capsys, *args), " characters cut]... ")
    assert len(line) <= ERROR_LINE_LIMIT and line.startswith(start) and line.endswith(end), line
    assert queued(db) == []


def test_error_line_cuts_only_past_its_limit_and_keeps_both_ends():
    from packbench.core.text import error_line

    assert error_line("e" * 100, limit=100) == "e" * 100  # at the limit: whole
    cut = error_line("a" * 61 + "b" * 40, limit=100)  # one past: 60 kept (40 first, 20 last), 41 cut
    assert cut == "a" * 40 + " ...[41 characters cut]... " + "b" * 20 and len(cut) <= 100
    assert error_line("cause \u202e\n fix") == "cause \\u202e\\n fix"  # one line, escaped


def test_a_usage_error_quoting_a_bidi_override_prints_it_escaped(tmp_path, db, capsys):
    """typer's own messages (an extra argument, an unknown option) printed U+202E and U+200B raw: a
    terminal reorders the rest of the line. They are escaped as packbench's own errors are."""
    line = one_line_error(pb(capsys, "results", "--passed", "\u202eevil\u200b"), "unexpected extra argument")
    assert "\u202e" not in line and "\u200b" not in line and "(\\u202eevil\\u200b)" in line, line
    line = one_line_error(pb(capsys, "status", "--\u202eevil"), "No such option")
    assert "\u202e" not in line and "--\\u202eevil" in line, line


@pytest.mark.parametrize("value, fragment", [
    ("!!bool maybe", "'maybe' is not a valid YAML bool"),  # KeyError in PyYAML's constructor
    ("!!int abc", "'abc' is not a valid YAML int"),  # ValueError
    ("!!float abc", "'abc' is not a valid YAML float"),
    ("!!timestamp abc", "'abc' is not a valid YAML timestamp"),  # AttributeError on a failed match
    ("2001-13-45 25:61:61", "is not a valid YAML timestamp"),  # a plain value YAML reads as a date: ValueError
    ('"\\ud800"', "a lone surrogate"),  # UnicodeEncodeError when the protocol was hashed
])
def test_a_yaml_value_its_tag_cannot_hold_is_one_line_naming_its_line(tmp_path, db, tiny, capsys, value, fragment):
    """Catches PyYAML's constructors raising KeyError / ValueError / AttributeError (and a lone
    surrogate reaching the UTF-8 hash) past the protocol loader: `protocol validate` exited 70."""
    text = yaml.safe_dump(quickstart(tiny)).replace("warmups: 1", f"warmups: {value}")
    assert f"warmups: {value}" in text
    one_line_error(pb(capsys, "protocol", "validate", str(write(tmp_path / "p.yaml", text))), "protocol line", fragment)


@pytest.mark.parametrize("spec, fragment", [
    ("prefix_tokens=[", "'[' is not a YAML value"),  # yaml.safe_load's ParserError: exit 70
    ("prefix_tokens=*a", "undefined alias"),  # ComposerError
    ("prefix_tokens=!!python/object:os.system", "could not determine a constructor"),
    ("prefix_tokens=!!bool maybe", "is not a valid YAML bool"),  # KeyError
    ("prefix_tokens=2001-13-45", "is not a valid YAML timestamp"),  # ValueError
    ("conditions.\u00b2=x", "conditions has 2 items"),  # "²".isdigit() holds, int("²") raised ValueError
])
def test_a_sweep_value_that_is_no_yaml_is_one_line_and_queues_nothing(tmp_path, db, tiny, capsys, spec, fragment):
    """Catches `--sweep FIELD=V1,...` reading each value with a bare yaml.safe_load (its errors, a
    tag its constructor cannot hold) and indexing a list with any str.isdigit() key: exit 70."""
    p = write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny)))
    one_line_error(pb(capsys, "protocol", "plan", str(p), "--sweep", spec), "--sweep", fragment)
    one_line_error(pb(capsys, "submit", str(p), "--sweep", spec), "--sweep", fragment)
    assert queued(db) == []


@pytest.fixture(scope="module")
def synthetic_archive(tmp_path_factory) -> Path:
    from bench.audit import synthetic_protocol, write_synthetic_screen

    path = tmp_path_factory.mktemp("screen") / "screen.zip"
    write_synthetic_screen(path, synthetic_protocol(prompts_n=2, repetitions=2))
    return path


def _forged(src: Path, dst: Path, name: str, edit) -> Path:
    """A consistent forgery: member `name`'s JSON edited, the manifest recomputed over it."""
    from packbench.core.archive import MANIFEST_NAME, ArchiveReader, ArchiveWriter
    from packbench.core.canonical import canonical_json

    with ArchiveReader(src) as r:
        data = {n: r.read_bytes(n) for n in r.names}
    w = ArchiveWriter(dst)
    for member, raw in data.items():
        if member != MANIFEST_NAME:
            w.add_bytes(member, canonical_json(edit(json.loads(raw))) if member == name else raw)
    old = json.loads(data[MANIFEST_NAME])
    w.seal({k: v for k, v in old.items() if k not in ("members", "format_version")})
    return dst


@pytest.mark.parametrize("name, edit", [
    ("worker.json", lambda w: None),  # AttributeError: 'NoneType' object has no attribute 'get'
    ("worker.json", lambda w: {**w, "start": "x"}),  # ValueError in dict("x")
    ("verdicts.json", lambda v: "x"),  # TypeError: string indices must be integers
    ("verdicts.json", lambda v: [{}]),  # KeyError: 'passed'
    ("verdicts.json", lambda v: [{**v[0], "condition": None}, *v[1:]]),  # None.startswith
])
def test_report_of_a_forged_archive_is_one_line(tmp_path, db, capsys, synthetic_archive, name, edit):
    """Catches `packbench report FILE.zip` drawing a consistent forgery (manifest recomputed, so
    the hashes hold) whose worker.json or verdicts.json is not of the format: exit 70 from the
    page's code. The auditor already named such members; the report now says so in one line."""
    forged = _forged(synthetic_archive, tmp_path / "forged.zip", name, edit)
    one_line_error(pb(capsys, "report", str(forged), "--out", str(tmp_path / "r.html")),
                   "is not of the archive format", "packbench audit archive")
    assert not (tmp_path / "r.html").exists()
def test_status_counts_no_worker_of_a_killed_dispatcher(tmp_path, db, tiny, capsys):
    """Bug caught: with the only dispatcher SIGKILLed (listed live `NO (its process is gone)`, its
    heartbeat fresh), `status` still said "workers of live dispatchers: 0 idle, 1 busy", and its
    --json `busy_workers` 1."""
    import json
    import os
    import platform
    import subprocess

    from packbench.db.store import Store
    from packbench.service.submit import submit

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store = Store(db)
    submit(store, write(tmp_path / "p.yaml", yaml.safe_dump(quickstart(tiny))))
    dead = store.register_dispatcher(f"dispatch-{platform.node()}-{gone.pid}", platform.node(), pid=gone.pid)
    store.claim_screen(dead, lease_s=60, archive_dir=str(tmp_path / "archives"), source_freeze={})
    store.heartbeat(dead, [{"name": "worker-1", "state": "busy"}])
    live = store.register_dispatcher(f"dispatch-{platform.node()}-{os.getpid()}", platform.node(), pid=os.getpid())
    store.heartbeat(live, [{"name": "worker-1", "state": "idle"}])
    r = pb(capsys, "status")
    assert r.code == 0 and "NO (its process is gone)" in r.out, (r.out, r.err)
    assert r.out.rstrip().endswith("workers of live dispatchers: 1 idle, 0 busy"), r.out
    r = pb(capsys, "status", "--json")
    document = json.loads(r.out)
    assert (document["idle_workers"], document["busy_workers"]) == (1, 0)
