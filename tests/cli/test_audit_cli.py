"""`packbench audit --archive`, `keys` and `ingest` exit codes (docs/archive.md): 0 agree, 1
disagree or refused evidence, 2 usage or unreadable input; the audit's own result is printed
even when recording it fails.

The commands run in this process through the console entry point (tests/in_process.py: the
tests through tests/conftest.py `packbench_cli`, the module's fixture directly)."""

import hashlib
import json
from pathlib import Path

import pytest

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.archive import MANIFEST_NAME, ArchiveReader, file_sha256
from packbench.core.provenance import Signer, generate_key
from packbench.db.store import Store
from in_process import run_packbench  # tests/in_process.py


def url_of(db: Path | str) -> str:
    return db if isinstance(db, str) else f"sqlite:///{db}"


@pytest.fixture
def cli(packbench_cli, monkeypatch):
    """`packbench ARGS` in `cwd` against the database `db`, no signing key of the caller's."""
    monkeypatch.delenv("PACKBENCH_SIGNING_KEY", raising=False)
    return lambda *args, cwd, db: packbench_cli(*args, env={"PACKBENCH_DB_URL": url_of(db)}, cwd=cwd)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("cli-audit")
    archive = d / "screen.zip"
    write_synthetic_screen(archive, synthetic_protocol(prompts_n=2, repetitions=2))
    db = d / "packbench.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PACKBENCH_SIGNING_KEY", raising=False)
        env = {"PACKBENCH_DB_URL": url_of(db)}
        assert run_packbench("db", "upgrade", cwd=d, env=env).returncode == 0
        r = run_packbench("keys", "init", "--key", str(d / "lab.pem"), "--name", "this lab", cwd=d, env=env)
    assert r.returncode == 0, r.stderr
    signer = Signer.load(d / "lab.pem")
    signed = d / "signed.zip"
    signed.write_bytes(archive.read_bytes())
    with ArchiveReader(signed) as reader:
        manifest_sha = hashlib.sha256(reader.read_bytes(MANIFEST_NAME)).hexdigest()
    signer.sign_archive(signed, file_sha256(signed), manifest_sha)
    return {"dir": d, "archive": archive, "signed": signed, "db": db, "pub": d / "lab.pem.pub", "key_id": signer.key_id}


def test_agree_is_0_and_disagree_is_1(world, cli):
    d = world["dir"]
    r = cli("audit", "--archive", str(world["archive"]), cwd=d, db=world["db"])
    assert r.returncode == 0 and "AGREE" in r.stdout, (r.stdout, r.stderr)
    forged = d / "forged.zip"
    raw = bytearray(world["archive"].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    forged.write_bytes(bytes(raw))
    r = cli("audit", "--archive", str(forged), cwd=d, db=world["db"])
    assert r.returncode == 1 and "DISAGREE" in r.stdout, (r.stdout, r.stderr)


def test_unreadable_input_is_2_without_a_traceback(world, cli):
    d = world["dir"]
    junk = d / "junk.zip"
    junk.write_bytes(b"this is not a zip at all" * 10)
    r = cli("audit", "--archive", str(junk), cwd=d, db=world["db"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert "not a readable zip archive" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""  # no empty verdict table, no DISAGREE line for what is no archive
    r = cli("audit", "--archive", str(d / "absent.zip"), cwd=d, db=world["db"])
    assert r.returncode == 2 and r.stderr.strip().startswith("error: no archive at"), r.stderr
    r = cli("audit", "--archive", str(world["archive"]), "--trust", str(junk), cwd=d, db=world["db"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "public key" in r.stderr, r.stderr


def test_trust_accepts_only_a_valid_signature_by_a_trusted_key(world, tmp_path, cli):
    d = world["dir"]
    r = cli("audit", "--archive", str(world["signed"]), "--trust", str(world["pub"]), cwd=d, db=world["db"])
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"signature: valid, by trusted key {world['key_id']}" in r.stdout
    r = cli("audit", "--archive", str(world["archive"]), "--trust", str(world["pub"]), cwd=d, db=world["db"])
    assert r.returncode == 1 and "signature: unsigned" in r.stdout, r.stdout
    other = tmp_path / "other.pem"
    assert cli("keys", "init", "--key", str(other), "--no-db", cwd=d, db=world["db"]).returncode == 0
    r = cli("audit", "--archive", str(world["signed"]), "--trust", str(other) + ".pub", cwd=d, db=world["db"])
    assert r.returncode == 1 and "which is not trusted here" in r.stdout, r.stdout


def test_ingest_records_agreeing_signed_evidence_once_and_refuses_the_rest(world, cli):
    d, db = world["dir"], world["db"]
    before = len(Store(f"sqlite:///{db}").list_screens())
    r = cli("ingest", str(world["archive"]), cwd=d, db=db)  # unsigned: refused, nothing written
    assert r.returncode == 1 and "signature: unsigned" in r.stdout, (r.stdout, r.stderr)
    assert len(Store(f"sqlite:///{db}").list_screens()) == before
    r = cli("ingest", str(world["signed"]), cwd=d, db=db)  # the key registered by `keys init`
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "ingested" in r.stdout and world["key_id"] in r.stdout
    store = Store(f"sqlite:///{db}")
    screens = store.list_screens()
    assert len(screens) == before + 1
    attempt = store.latest_attempt(screens[-1].id)
    assert attempt.signer_key_id == world["key_id"] and attempt.ingested_from
    assert len(store.episodes(attempt.id)) == 10 and store.verdicts(attempt.id)
    r = cli("ingest", str(world["signed"]), cwd=d, db=db)  # the same archive twice
    assert r.returncode == 1 and "already in this database" in r.stdout, (r.stdout, r.stderr)
    assert len(Store(f"sqlite:///{db}").list_screens()) == before + 1
    # The ingested screen audits against the database like any other.
    r = cli("audit", str(screens[-1].id), cwd=d, db=db)
    assert r.returncode == 0 and "AGREE" in r.stdout, (r.stdout, r.stderr)
    assert f"signature: valid, by trusted key {world['key_id']}" in r.stdout  # the signer the row names
    # Against a read-only database: the audit's own result first, then the recording error, exit 2.
    r = cli("audit", str(screens[-1].id), cwd=d, db=f"sqlite:///file:{db}?mode=ro&uri=true")
    assert "AGREE" in r.stdout, (r.stdout, r.stderr)
    assert r.returncode == 2 and "was not recorded" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ingest_names_the_attempt_by_its_number_not_its_row_id(world, tmp_path, cli):
    """Into a database that held another attempt, `ingest` said 'as screen 2 (attempt 2)' for the
    screen's only attempt: the row id, where every other command names the attempt's number."""
    d, db = world["dir"], tmp_path / "pb.db"
    assert cli("db", "upgrade", cwd=d, db=db).returncode == 0
    other = tmp_path / "other.zip"  # a second signed archive: the same one twice is refused
    write_synthetic_screen(other, synthetic_protocol(prompts_n=3, repetitions=1))
    with ArchiveReader(other) as reader:
        manifest_sha = hashlib.sha256(reader.read_bytes(MANIFEST_NAME)).hexdigest()
    Signer.load(d / "lab.pem").sign_archive(other, file_sha256(other), manifest_sha)
    for archive, screen in ((world["signed"], 1), (other, 2)):
        r = cli("ingest", str(archive), "--trust", str(world["pub"]), cwd=d, db=db)
        assert r.returncode == 0, (r.stdout, r.stderr)
        with Store(url_of(db)) as store:
            attempt = store.latest_attempt(screen)
        assert attempt.number == 1 and attempt.id == screen
        assert f"as screen {screen} (attempt 1), " in r.stdout, r.stdout


def test_reexecution_refuses_what_it_cannot_rerun_with_one_line(world, tmp_path, cli):
    """Not a zip, or a partial archive: exit 2 and one line, before any worker starts."""
    d = world["dir"]
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"not a zip at all" * 64)
    partial = tmp_path / "partial.zip"
    write_synthetic_screen(partial, synthetic_protocol(prompts_n=2, repetitions=2), seal=False)
    for path, fragment in ((junk, "not an archive packbench can read"), (partial, "cannot be re-executed")):
        r = cli("audit", "--archive", str(path), "--reexecute", "2", cwd=d, db=world["db"])
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (r.stdout, r.stderr)
        assert fragment in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_reexecution_that_disagrees_on_time_alone_says_so_and_names_time_factor():
    from types import SimpleNamespace

    from packbench.cli.audit_cmd import reexecution_parts as _reexecution_parts

    slow = "condition packet: median episode wall 0.0259 s re-executed against 0.5233 s archived"
    timing_only = SimpleNamespace(problems=[slow], timing_problems=(slow,), exact_agrees=True,
                                  record={"time_factor": 2.0})
    line = _reexecution_parts(timing_only)
    assert line.startswith("exact part: logits, tokens and bytes all matched; timing part: 1 condition(s)' median "
                           "wall outside 2x") and "--time-factor" in line
    both = SimpleNamespace(problems=["episode 3 (packet): logits are not bit-identical", slow], timing_problems=(slow,),
                           exact_agrees=False, record={"time_factor": 2.0})
    assert "1 difference(s) in logits" in _reexecution_parts(both) and "--time-factor" not in _reexecution_parts(both)
    agree = SimpleNamespace(problems=[], timing_problems=(), exact_agrees=True, record={"time_factor": 2.0})
    assert _reexecution_parts(agree).endswith("timing part: medians within 2x")
    busy = SimpleNamespace(**{**vars(timing_only), "busy_hosts": (
        "the archived run's host was busy with other processes in 6 of 8 episodes (up to 1.4 cores)",)})
    assert _reexecution_parts(busy).endswith("; the archived run's host was busy with other processes in 6 of 8 "
                                             "episodes (up to 1.4 cores)")


def test_busy_hosts_name_the_run_whose_host_was_busy():
    from packbench.service.audit import _busy_hosts

    busy = {"plan_index": 0, "episode_s": 1.0, "host_load": {"other_cpu_s": 1.4}}
    quiet = {"plan_index": 1, "episode_s": 1.0, "host_load": {"other_cpu_s": 0.0}, "host_workers": []}
    assert _busy_hosts([busy, quiet], [quiet]) == (
        "the archived run's host was busy with other processes in 1 of 2 episodes (up to 1.4 cores)",)
    assert _busy_hosts([quiet], [{**quiet, "host_workers": [[7, "cpu"]]}]) == (
        "the re-run's host was shared with other packbench workers in 1 of 1 episodes",)


def test_repeated_audits_that_agree_with_different_digests_exit_1(monkeypatch):
    """`audit --repeat N`: exit 1 when repeated audits differ, though each agrees on its own
    (the command's docstring and README: "1 ... machines disagree"); the line names the screen.
    Catches the planted bug "audit cli: repeated audits with different digests exit 0"."""
    from types import SimpleNamespace

    import typer

    import packbench.cli.audit_cmd as audit_cmd

    monkeypatch.setattr(audit_cmd, "_print_audit", lambda o, **_: None)
    lines = []
    monkeypatch.setattr(audit_cmd.typer, "echo", lambda line, err=False: lines.append(line))

    def audit(digest):
        report = SimpleNamespace(digest=digest, agrees=True, unreadable=False)
        return SimpleNamespace(screen_id=3, report=report, agrees=True, unfinished=False, record_error=None)

    audit_cmd._finish([audit("a" * 64), audit("a" * 64)], json_out=False)  # the same digest twice: exit 0
    assert lines == []
    with pytest.raises(typer.Exit) as e:
        audit_cmd._finish([audit("a" * 64), audit("b" * 64)], json_out=False)
    assert e.value.exit_code == 1
    assert lines == ["problem: screen 3: repeated audits gave 2 different digests"]


def test_a_reexecution_stopped_by_sigterm_says_so_and_exits_143(world, cli, monkeypatch):
    """Bug caught: SIGTERM (a scheduler's time limit) while `audit reexecute` waited on its worker
    ended the command with exit 1 and no line, or 15, or Ray's stack dump and SIGABRT (134): the
    caller could not tell a stop from a disagreeing audit. Now one line and 143, as for submit; and
    SIGINT there says "interrupted", 130 (typer made it a bare 130 before)."""
    import os
    import signal
    import time

    import packbench.cluster.reexecute as reexecute
    from packbench.core import signals

    def stopped_by(sig):
        def run_drawn(*args, **kwargs):
            signals.install()  # as ensure_ray does once Ray is up
            os.kill(os.getpid(), sig)
            for _ in range(100):  # the handler runs in the main thread at its next check
                time.sleep(0.05)
            raise AssertionError("the signal did not stop the re-execution")
        return run_drawn

    d = world["dir"]
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    # Python's own SIGINT handler, whatever this process inherited: a test run started in the
    # background of a non-interactive shell (`make test &`) inherits SIGINT ignored, and then no
    # KeyboardInterrupt comes (as for any command run that way).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for sig, code, line in ((signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")):
            monkeypatch.setattr(signals, "received", [])
            monkeypatch.setattr(reexecute, "run_drawn", stopped_by(sig))
            r = cli("audit", "--archive", str(world["archive"]), "--reexecute", "2", cwd=d, db=world["db"])
            assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (code, line), (r.stdout, r.stderr)
            assert "Traceback" not in r.stderr and "re-execution audit" not in r.stdout
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_a_signer_trusted_by_flag_at_ingest_stays_trusted_for_the_screens_later_audits(world, cli, tmp_path):
    """Bug caught: `ingest ARCHIVE --trust LAB.pub` with a key not registered here accepted the
    evidence, and every later `audit SCREEN` (so `audit --all` in CI) called it DISAGREE: the
    signature was checked against the keys registered in the database, which lacked it. The key
    is now registered in the ingest's own transaction, and said so; a refused ingest registers nothing."""
    d = world["dir"]
    db = tmp_path / "other.db"  # a database that has never seen the lab's key
    assert cli("db", "upgrade", cwd=d, db=db).returncode == 0
    forged = tmp_path / "forged.zip"
    raw = bytearray(world["signed"].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    forged.write_bytes(bytes(raw))
    r = cli("ingest", str(forged), "--trust", str(world["pub"]), cwd=d, db=db)
    assert r.returncode == 1 and Store(url_of(db)).signers() == []  # refused: nothing registered
    r = cli("ingest", str(world["signed"]), "--trust", str(world["pub"]), cwd=d, db=db)
    assert r.returncode == 0 and f"registered key {world['key_id']} (given with --trust)" in r.stdout, r.stdout
    (signer,) = Store(url_of(db)).signers()
    assert (signer.key_id, signer.name, signer.local) == (world["key_id"], "lab.pem.pub (--trust at ingest)", False)
    (screen,) = Store(url_of(db)).list_screens()
    r = cli("audit", str(screen.id), cwd=d, db=db)
    assert r.returncode == 0 and "AGREE" in r.stdout, (r.stdout, r.stderr)
    assert f"signature: valid, by trusted key {world['key_id']}" in r.stdout
    r = cli("ingest", str(world["signed"]), "--trust", str(world["pub"]), cwd=d, db=db)  # again: refused, once
    assert r.returncode == 1 and "registered key" not in r.stdout and len(Store(url_of(db)).signers()) == 1


def test_the_audit_verdict_table_labels_each_rows_tier(world, cli):
    """README: every table labels each row's tier. The audit's verdict table had no tier column
    (its recomputed verdicts carry none), unlike `submit --wait`'s, `results`' and `screens show`'s;
    it takes each condition's tier from the archive's protocol, and the digest does not move."""
    d = world["dir"]
    r = cli("audit", "--archive", str(world["archive"]), cwd=d, db=world["db"])
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("gate "))
    assert header.split()[:4] == ["gate", "condition", "tier", "phase"], header
    rows = [line.split() for line in lines[lines.index(header) + 1:] if line and not line.startswith("audit of")]
    assert rows and all(row[2] == "exact" for row in rows), rows


def test_screen_ids_with_all_since_or_protocol_are_refused_not_half_heeded(world, cli):
    """Bug caught: `audit screen 1 --protocol moe-trace` audited screen 1 (another protocol's)
    and exited 0, `--since` and `--all` beside ids were dropped alike: the ids won and the
    filter the user asked for went unheeded, unsaid. Now one line, exit 2, nothing audited."""
    d = world["dir"]
    for extra, named in ((["--protocol", "x"], "--protocol"), (["--since", "2030-01-01"], "--since"),
                         (["--all"], "--all")):
        for form in (["audit", "screen", "1"], ["audit", "reexecute", "1"]):
            r = cli(*form, *extra, cwd=d, db=world["db"])
            assert r.returncode == 2 and "Traceback" not in r.stderr, (form, extra, r.stdout, r.stderr)
            assert r.stderr.strip() == (f"error: screen ids and {named} both select screens, and {named} would go "
                                        f"unheeded: give the ids alone, or {named} without ids"), r.stderr
            assert r.stdout == ""


def test_screens_show_and_compare_say_who_signed_an_ingested_screen(world, cli, tmp_path):
    """Bug caught: `screens show` and `compare` never said that a screen was ingested nor whose key
    signed it (`keys register --name` promised `compare` shows the name): an archive from another
    lab read like one measured here. And an ingested attempt's claim-to-end read 0 s, its start
    and finish being the ingest's own clock time. Both now say where it came from and who signed,
    by key id and registered name; the claim-to-end is unknown (-)."""
    d, db = world["dir"], tmp_path / "pb.db"
    assert cli("db", "upgrade", cwd=d, db=db).returncode == 0
    assert cli("keys", "register", str(world["pub"]), "--name", "Lab One", cwd=d, db=db).returncode == 0
    other = tmp_path / "other.zip"  # a second archive, signed by a key registered nowhere
    write_synthetic_screen(other, synthetic_protocol(prompts_n=3, repetitions=1))
    with ArchiveReader(other) as reader:
        manifest_sha = hashlib.sha256(reader.read_bytes(MANIFEST_NAME)).hexdigest()
    other_key = Signer.load(generate_key(tmp_path / "other.pem")[0])
    other_key.sign_archive(other, file_sha256(other), manifest_sha)
    assert cli("ingest", str(world["signed"]), cwd=d, db=db).returncode == 0
    r = cli("ingest", str(other), "--trust", str(tmp_path / "other.pem.pub"), cwd=d, db=db)
    assert r.returncode == 0, (r.stdout, r.stderr)
    kid, okid = world["key_id"], other_key.key_id

    r = cli("screens", "show", "1", cwd=d, db=db)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header, row = lines[lines.index("attempts") + 1], lines[lines.index("attempts") + 2]
    assert "signed by" in header and f"{kid} 'Lab One'" in row
    time_header, time_row = lines[lines.index("time (s; from each attempt's archive)") + 1:][:2]
    claim = time_header.index("claim_to_end")
    assert time_row[claim:].split()[0] == "-"  # not 0: nothing claimed it here
    assert "10 episodes; ingested: its started and finished times are the ingest's" in time_row

    r = cli("compare", "1", "2", cwd=d, db=db)
    assert r.returncode == 0, r.stderr
    a, b = r.stdout.splitlines()[:2]
    assert a.endswith(f"attempt 1 done, ingested from synthetic, signed by {kid} 'Lab One'"), a
    assert b.endswith(f"attempt 1 done, ingested from synthetic, signed by {okid} 'other.pem.pub (--trust at ingest)'"), b
    r = cli("compare", "1", "2", "--json", cwd=d, db=db)
    assert json.loads(r.stdout)["provenance"] == {
        "a": {"signer_key_id": kid, "signer_name": "Lab One", "signer_revoked_at": None,
              "ingested_from": f"synthetic (signed by {kid})"},
        "b": {"signer_key_id": okid, "signer_name": "other.pem.pub (--trust at ingest)", "signer_revoked_at": None,
              "ingested_from": f"synthetic (signed by {okid})"}}


def test_a_local_attempt_says_unsigned_or_names_an_unregistered_signer():
    """The words for an attempt measured here: unsigned, or a key the database does not hold."""
    from types import SimpleNamespace

    from packbench.cli.query import provenance_text

    local = SimpleNamespace(signer_key_id=None, ingested_from=None, node="n1")
    assert provenance_text(local, {}) == "unsigned"
    signed = SimpleNamespace(signer_key_id="ab" * 8, ingested_from=None, node="n1")
    assert provenance_text(signed, {"ab" * 8: "local"}) == f"signed by {'ab' * 8} 'local'"
    assert provenance_text(signed, {}) == f"signed by {'ab' * 8} (not registered here)"
