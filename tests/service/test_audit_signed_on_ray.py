"""An audit of a signed attempt on Ray checks its signature as a local one does, and gives the
same digest; a copy shipped to a node without the file carries its detached signature."""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

from bench.audit import synthetic_protocol, write_synthetic_screen
from packbench.core.archive import MANIFEST_NAME, ArchiveReader, file_sha256
from packbench.core.audit import audit_archive
from packbench.core.provenance import Signer, generate_key
from packbench.service.audit import audit_screens
from packbench.service.ingest import ingest


def signed_screen(store, tmp_path: Path) -> int:
    archive = tmp_path / "screen.zip"
    write_synthetic_screen(archive, synthetic_protocol(prompts_n=2, repetitions=1))
    key, pub, _ = generate_key(tmp_path / "lab.pem")
    with ArchiveReader(archive) as reader:
        manifest_sha = hashlib.sha256(reader.read_bytes(MANIFEST_NAME)).hexdigest()
    Signer.load(key).sign_archive(archive, file_sha256(archive), manifest_sha)
    outcome = ingest(store, archive, trust_files=[pub])
    assert outcome.ingested, outcome.reasons
    return outcome.screen_id


def test_a_signed_attempt_audited_on_ray_checks_its_signature_and_digest_matches_local(store, tmp_path, monkeypatch):
    """Bug caught: `audit SCREEN --ray` of a signed attempt never checked its signature (only the
    local path passed the registered key), so its audit record lacked `signature` and its digest
    differed from the local audit's for the same archive and rows; a removed .sig audited AGREE."""
    import packbench.cluster.audit as cluster_audit

    def fan_out(jobs, **_):  # the cluster's task, run here: what matters is what each job carries
        return [cluster_audit.AuditDone(job, audit_archive(Path(job.path), **job.compare), "node", "host", False)
                for job in jobs]

    monkeypatch.setattr(cluster_audit, "fan_out", fan_out)
    screen_id = signed_screen(store, tmp_path)
    (local,) = audit_screens(store, [screen_id])
    (on_ray,) = audit_screens(store, [screen_id], on_ray=True)
    assert local.result == on_ray.result == "agree"
    assert on_ray.report.record["signature"] == local.report.record["signature"]
    assert on_ray.report.record["signature"]["status"] == "valid"
    assert on_ray.report.digest == local.report.digest
    (tmp_path / "screen.zip.sig").unlink()
    (on_ray,) = audit_screens(store, [screen_id], on_ray=True)
    assert on_ray.result == "disagree" and on_ray.report.record["signature"]["status"] == "unsigned"


def test_a_shipped_copy_carries_the_detached_signature(store, tmp_path, monkeypatch):
    """Bug caught: a node without the archive audited a shipped copy of its bytes alone, so a
    signed archive read as unsigned there (DISAGREE) while the node with the file agreed."""
    from packbench.cluster.audit import _audit_here

    context = types.SimpleNamespace(get_node_id=lambda: "node")
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get_runtime_context=lambda: context))
    screen_id = signed_screen(store, tmp_path)
    path = tmp_path / "screen.zip"
    attempt = store.latest_attempt(screen_id)
    trust = [bytes.fromhex(s.public_key) for s in store.signers() if s.key_id == attempt.signer_key_id]
    here = _audit_here(str(path), None, {"trust": trust})
    elsewhere = _audit_here(str(tmp_path / "elsewhere" / path.name), path.read_bytes(), {"trust": trust},
                            (tmp_path / "screen.zip.sig").read_bytes())
    assert here["record"]["signature"]["status"] == "valid" and elsewhere["shipped"] is True
    assert elsewhere["record"] == here["record"]
