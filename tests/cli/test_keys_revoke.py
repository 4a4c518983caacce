"""`packbench keys revoke KEY_ID`: a key lost, or a lab no longer trusted. From then on `ingest`
refuses the key's archives (given with --trust too), the dispatcher refuses to sign with it, and
what it signed before is kept and shown as signed by a revoked key (`screens show`, `compare`,
`keys list`). Without the command a user had no way to stop trusting a key."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.archive import MANIFEST_NAME, ArchiveReader, file_sha256
from packbench.core.provenance import Signer, generate_key
from packbench.db.store import Store

ROOT = Path(__file__).resolve().parents[2]


def signed_screen(path: Path, signer: Signer, *, prompts: int) -> Path:
    write_synthetic_screen(path, synthetic_protocol(prompts_n=prompts, repetitions=1))
    with ArchiveReader(path) as reader:
        manifest_sha = hashlib.sha256(reader.read_bytes(MANIFEST_NAME)).hexdigest()
    signer.sign_archive(path, file_sha256(path), manifest_sha)
    return path


@pytest.fixture
def lab(tmp_path, packbench_cli, monkeypatch):
    """A database trusting 'Lab One', one archive of that lab ingested and another not yet."""
    monkeypatch.delenv("PACKBENCH_SIGNING_KEY", raising=False)
    db = tmp_path / "pb.db"

    def pb(*args):
        return packbench_cli(*args, env={"PACKBENCH_DB_URL": f"sqlite:///{db}"}, cwd=tmp_path)

    assert pb("db", "upgrade").returncode == 0
    key, pub, kid = generate_key(tmp_path / "lab.pem")
    assert pb("keys", "register", str(pub), "--name", "Lab One").returncode == 0
    signer = Signer.load(key)
    first = signed_screen(tmp_path / "first.zip", signer, prompts=2)
    assert pb("ingest", str(first)).returncode == 0
    return {"pb": pb, "db": db, "kid": kid, "pub": pub, "key": key,
            "second": signed_screen(tmp_path / "second.zip", signer, prompts=3)}


def test_a_revoked_keys_archives_are_refused_and_what_it_signed_is_kept_and_marked(lab):
    """Bug: no way to revoke a key: a lost key's archives kept being ingested, and the screens it
    signed read as any other's."""
    pb, kid = lab["pb"], lab["kid"]
    r = pb("keys", "revoke", kid)
    assert r.returncode == 0 and r.stdout.startswith(f"revoked key {kid} ('Lab One') at "), (r.stdout, r.stderr)
    r = pb("keys", "revoke", kid)  # again: said, the first time kept
    assert r.returncode == 0 and f"key {kid} ('Lab One') was already revoked at " in r.stdout, r.stdout
    (row,) = json.loads(pb("keys", "list", "--json").stdout)["keys"]
    assert row["key_id"] == kid and row["revoked_at"] is not None
    assert "REVOKED" in pb("keys", "list").stdout

    for trust in ([], ["--trust", str(lab["pub"])]):  # --trust does not bring a revoked key back
        r = pb("ingest", str(lab["second"]), *trust)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert f"problem: signature: by key {kid} ('Lab One'), revoked at " in r.stdout, r.stdout
        assert "nothing was written" in r.stderr
    with Store(f"sqlite:///{lab['db']}") as store:
        assert len(store.list_screens()) == 1  # the screen ingested before is kept, nothing added
        assert store.latest_attempt(1).signer_key_id == kid

    r = pb("screens", "show", "1")
    assert r.returncode == 0 and f"{kid} 'Lab One', a key REVOKED at " in r.stdout, r.stdout
    r = pb("compare", "1", "1")
    assert r.returncode == 0 and f"signed by {kid} 'Lab One', a key REVOKED at " in r.stdout.splitlines()[0], r.stdout
    provenance = json.loads(pb("compare", "1", "1", "--json").stdout)["provenance"]["a"]
    assert provenance["signer_key_id"] == kid and provenance["signer_revoked_at"] is not None


@pytest.mark.parametrize("key_id", ["0123456789abcdef", "x" * 10_000])
def test_revoking_a_key_not_registered_is_one_line(lab, key_id):
    r = lab["pb"]("keys", "revoke", key_id)
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert "no registered signing key" in line and "`packbench keys list`" in line and len(line) < 200


def test_the_dispatcher_refuses_to_sign_with_a_revoked_local_key(lab, tmp_path, tiny):
    """Bug: a revoked key (lost: anyone may hold it) still signed every archive the dispatcher
    sealed. `submit --wait` refuses it before queuing anything, `dispatch` before claiming."""
    pb = lab["pb"]
    key, _, kid = generate_key(tmp_path / "ours.pem")
    assert pb("keys", "init", "--key", str(tmp_path / "unused.pem"), "--no-db").returncode == 0
    with Store(f"sqlite:///{lab['db']}") as store:
        store.put_signer(key_id=kid, public_key=Signer.load(key).public_raw.hex(), name="ours", local=True)
    assert pb("keys", "revoke", kid).returncode == 0
    body = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    body["model"] = {"path": str(tiny)}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(body))
    for args in (("submit", str(tmp_path / "p.yaml"), "--wait"), ("dispatch", "--archive-dir", str(tmp_path / "a"))):
        r = pb("--signing-key", str(key), *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith(f"error: the signing key {key} (key id {kid}) was revoked at "), line
        assert "packbench keys init --key NEW.pem" in line
    with Store(f"sqlite:///{lab['db']}") as store:
        assert len(store.list_screens()) == 1  # only the ingested one: nothing queued
    assert not os.path.exists(tmp_path / "a") or not any((tmp_path / "a").iterdir())


def test_registering_a_revoked_key_again_is_refused_and_audit_names_it_revoked(lab):
    """Bugs caught: `keys register` of a revoked key said "trusting key ..." and exited 0, though
    the key stayed revoked (nothing was trusted); `audit` of a screen it signed said "signature:
    valid, by trusted key ..." after the key was revoked."""
    pb, kid = lab["pb"], lab["kid"]
    r = pb("audit", "1")
    assert r.returncode == 0 and f"signature: valid, by trusted key {kid}" in r.stdout, (r.stdout, r.stderr)
    assert pb("keys", "revoke", kid).returncode == 0
    r = pb("keys", "register", str(lab["pub"]), "--name", "Lab One again")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "trusting" not in r.stdout, (r.stdout, r.stderr)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: key {kid} ('Lab One') was revoked at ") and "stays revoked" in line, line
    (row,) = json.loads(pb("keys", "list", "--json").stdout)["keys"]
    assert row["revoked_at"] is not None and row["name"] == "Lab One"
    r = pb("audit", "1")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "trusted key" not in r.stdout and f"signature: valid, by key {kid}, REVOKED at " in r.stdout, r.stdout


def test_audit_json_carries_the_revocation_and_the_result_stays_the_archive_s(lab):
    """Bug caught: `audit SCREEN` of a screen signed by a key revoked since said REVOKED on its
    signature line, but `audit --json` printed signature {status: valid, key_id} alone: a script
    could not tell a revoked signer from a trusted one. The result stays AGREE: the archive's
    content is what the audit judges."""
    pb, kid = lab["pb"], lab["kid"]
    before = json.loads(pb("audit", "1", "--json").stdout)
    assert before["signature"] == {"status": "valid", "key_id": kid, "revoked_at": None}
    assert pb("keys", "revoke", kid).returncode == 0
    (row,) = json.loads(pb("keys", "list", "--json").stdout)["keys"]
    r = pb("audit", "1", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    after = json.loads(r.stdout)
    assert after["result"] == "agree" and after["digest"] == before["digest"]
    assert after["signature"]["status"] == "valid" and after["signature"]["key_id"] == kid
    assert after["signature"]["revoked_at"] is not None
    assert after["signature"]["revoked_at"][:16] == row["revoked_at"][:16]
