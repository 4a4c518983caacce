"""An archive over the reader's size bound (docs/archive.md, "Bounds"), from audit to results: the
audit is recorded as a failed (`disagree`) audit with a null SHA-256 (migration 0012) and one line
naming the size, the bound and `packbench audit SCREEN --max-mib N`; `results` and `screens show`
say the same instead of an exception's name. The bound is lowered (monkeypatched) so that a small
synthetic archive is "over" it."""

import hashlib
import json

import pytest
from typer.testing import CliRunner

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.cli.main import app
from packbench.core.archive import MANIFEST_NAME, MAX_JSON_TOTAL_BYTES, ArchiveReader, file_sha256, mib_to_admit
from packbench.core.archive import reader as archive_reader
from packbench.core.provenance import Signer
from packbench.db.store import Store


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture()
def world(tmp_path, monkeypatch) -> dict:
    archive = tmp_path / "screen.zip"
    write_synthetic_screen(archive, synthetic_protocol(prompts_n=1, repetitions=1))
    url = f"sqlite:///{tmp_path / 'packbench.db'}"
    assert invoke("db", "upgrade", "--db", url).exit_code == 0
    monkeypatch.delenv("PACKBENCH_SIGNING_KEY", raising=False)
    r = invoke("keys", "init", "--key", str(tmp_path / "lab.pem"), "--name", "lab", "--db", url)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    signer = Signer.load(tmp_path / "lab.pem")
    with ArchiveReader(archive) as reader:
        manifest_sha = hashlib.sha256(reader.read_bytes(MANIFEST_NAME)).hexdigest()
    signer.sign_archive(archive, file_sha256(archive), manifest_sha)  # ingest takes signed evidence only
    r = invoke("ingest", str(archive), "--db", url, "--json")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    size = archive.stat().st_size
    bound = size // 2
    monkeypatch.setattr(archive_reader, "MAX_ARCHIVE_BYTES", bound)
    return {"archive": archive, "url": url, "size": size, "bound": bound}


def test_an_audit_over_the_bound_is_recorded_with_one_line_and_the_max_mib_that_reads_it(world):
    url, size, bound = world["url"], world["size"], world["bound"]
    r = invoke("audit", "1", "--db", url)
    # Catches the old words ("SHA-256 None differs") and the NOT NULL that lost the audit (exit 2 +
    # "was not recorded").
    assert r.exit_code == 2, (r.stdout, r.stderr)
    assert "None" not in r.stderr and "differs" not in r.stderr and "not recorded" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    n = mib_to_admit(size + MAX_JSON_TOTAL_BYTES)
    # The audit names the file "the archive" (its record and digest do not depend on where it lies).
    assert line == (f"error: audit of screen 1: the archive is {size} bytes, over the audit bound of {bound} bytes, "
                    f"so it was not read; only for an archive you trust, audit it with `packbench audit 1 --max-mib "
                    f"{n}`"), line
    with Store(url) as store:
        attempt = store.latest_attempt(1)
        [audit] = store.audits(attempt.id)
    # Every field the promise names: recorded, failed, unhashed, its first problem the line printed
    # (the lab's key is registered, so the signature that cannot be checked is the second).
    assert (audit.result, audit.archive_sha256, audit.problems) == (
        "disagree", None, (line[len("error: audit of screen 1: "):],
                           "signature: the archive is over the size bound, so no signature can hold for it"))
    # The fix the line names reads the archive: it agrees, hashed, recorded beside the failed one.
    r = invoke("audit", "1", "--max-mib", str(n), "--db", url)
    assert r.exit_code == 0 and "AGREE" in r.stdout, (r.stdout, r.stderr)
    with Store(url) as store:
        audits = store.audits(attempt.id)
    assert [(a.result, a.archive_sha256) for a in audits] == [("disagree", None),
                                                              ("agree", file_sha256(world["archive"]))]


def test_json_audit_over_the_bound_says_unhashed_and_exits_2(world):
    r = invoke("audit", "1", "--db", world["url"], "--json")
    assert r.exit_code == 2, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert (doc["result"], doc["archive_sha256"], len(doc["problems"])) == ("disagree", None, 2)
    assert f"--max-mib {mib_to_admit(world['size'] + MAX_JSON_TOTAL_BYTES)}" in doc["problems"][0]


def test_results_and_screens_show_name_the_bound_and_the_fix(world):
    url, size = world["url"], world["size"]
    fix = f"`packbench audit 1 --max-mib {mib_to_admit(size + MAX_JSON_TOTAL_BYTES)}`"
    doc = json.loads(invoke("results", "--screen", "1", "--db", url, "--json").stdout)
    # Catches readings that vanish silently (None) for an archive that is only too large to read.
    assert doc["archive_not_read"].endswith(fix) and f"is {size} bytes" in doc["archive_not_read"]
    text = invoke("results", "--screen", "1", "--db", url).stdout
    assert f"archive readings: none; {world['archive']} is {size} bytes" in text and fix in text
    shown = json.loads(invoke("screens", "show", "1", "--db", url, "--json").stdout)
    # Catches the bare exception name ("archive not readable here (ArchiveError)").
    assert shown["time"][0]["note"].startswith("archive not readable here: ") and shown["time"][0]["note"].endswith(fix)
    invoke("audit", "1", "--db", url)
    text = invoke("screens", "show", "1", "--db", url).stdout + invoke("results", "--screen", "1", "--db", url).stdout
    assert "never hashed" in text and "of another archive SHA-256" not in text, text


def test_audit_archive_over_the_bound_names_the_file_in_its_fix(world):
    """`audit archive FILE` (no database): exit 2 and one line whose command names the very file."""
    r = invoke("audit", "archive", str(world["archive"]))
    assert r.exit_code == 2, (r.stdout, r.stderr)
    [line] = r.stderr.strip().splitlines()
    # Catches a fix that says "audit archive the archive" (the record's scrubbed path) or FILE.
    assert line.endswith(f"`packbench audit archive {world['archive']} --max-mib {mib_to_admit(world['size'] + MAX_JSON_TOTAL_BYTES)}`"), line
    assert r.stdout == ""


def test_audit_archive_whose_members_are_over_the_bound_names_the_file_in_its_fix(tmp_path, monkeypatch):
    """A file within the file bound whose members declare more than the members' bound: the
    suggested command names the very file, quoted where the shell needs it, never the placeholder
    `archive FILE` nor the record's scrubbed "the archive"."""
    from packbench.core.archive import ArchiveWriter

    monkeypatch.setattr(archive_reader, "MAX_ARCHIVE_BYTES", 1 << 20)  # the file: within its bound
    monkeypatch.setattr(ArchiveReader.__init__, "__kwdefaults__",  # its members: over theirs
                        {**ArchiveReader.__init__.__kwdefaults__, "max_total_bytes": 1000})
    archive = tmp_path / "with space" / "members.zip"
    archive.parent.mkdir()
    w = ArchiveWriter(archive)
    w.add_bytes("blob.npy", bytes(3000))
    w.seal({})
    r = invoke("audit", "archive", str(archive))
    assert r.exit_code != 0, (r.stdout, r.stderr)
    out = r.stdout + r.stderr
    assert "declares members of" in out and f"`packbench audit archive '{archive}' --max-mib 1`" in out, out
    assert "archive FILE" not in out and "archive the archive" not in out, out
