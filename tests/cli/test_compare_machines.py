"""`packbench compare --protocol SHA`: one protocol screened on several machines, verdict by verdict."""

import csv
import io
import json

from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.db.store import Store

FREEZE = {"git": "abc"}


def verdict(gate, condition, passed, value):
    return {"gate": gate, "condition": condition, "phase": "all", "passed": passed, "value": value, "threshold": 0.5,
            "interval": None, "episodes": [0], "detail": ""}


def screened(store, protocol_id, *, host, node, verdicts, status="done"):
    screen = store.create_screen(protocol_id=protocol_id, submitter="lab")
    d = store.register_dispatcher("d", host)
    machine = store.put_machine(host=host, gpu_name="NVIDIA H200", driver="580", torch="2.11", cuda="13.0")
    c = store.claim_screen(d, lease_s=60, archive_dir="/a", source_freeze=FREEZE, node=node, gpu_name="NVIDIA H200",
                           gpu_index=0, machine_id=machine)
    store.put_verdicts(c.attempt.id, verdicts)
    store.finish_attempt(c.attempt.id, status=status, error=None if status == "done" else "died")
    return screen


def test_machines_side_by_side_and_their_agreement(tmp_path):
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()
        p = store.put_protocol(sha256="ab" * 32, name="seed-v040", canonical_json="{}")
        q = store.put_protocol(sha256="cd" * 32, name="other", canonical_json="{}")
        same = [verdict("faithfulness", "packet", True, 0.0), verdict("acquisition", "packet", True, 0.16)]
        a = screened(store, p, host="lab-a", node="node-a", verdicts=same)
        b = screened(store, p, host="lab-b", node="node-b", verdicts=same)
        failed = screened(store, p, host="lab-c", node="node-c", verdicts=[], status="failed")
        screened(store, q, host="lab-a", node="node-a", verdicts=same)
    runner = CliRunner()
    out = runner.invoke(app, ["compare", "--protocol", "abab", "--db", url, "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["agree"] is True and [c["screen_id"] for c in data["columns"]] == [a, b]
    assert {c["machine"] for c in data["columns"]} == {"lab-a / NVIDIA H200 #0", "lab-b / NVIDIA H200 #0"}
    assert data["skipped"] == [f"screen {failed}: failed, no done attempt"]
    with Store(url) as store:
        screened(store, p, host="lab-d", node="node-d",
                 verdicts=[verdict("faithfulness", "packet", False, 3e-3), verdict("acquisition", "packet", True, 0.2)])
    out = runner.invoke(app, ["compare", "--protocol", "seed-v040", "--db", url, "--format", "csv"])
    assert out.exit_code == 1  # disagreement: in every format
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    faith = next(r for r in rows if r["gate"] == "faithfulness")
    assert (faith["agree"], faith[f"[1] screen {a}"], faith["[3] screen 5"]) == ("False", "PASS 0", "FAIL 0.003")
    out = runner.invoke(app, ["compare", "--protocol", "seed-v040", "--db", url])
    assert out.exit_code == 1 and "verdicts agree across machines: NO" in out.output
    assert "faithfulness" in out.output and "NO" in out.output.split("faithfulness", 1)[1].splitlines()[0]
    bad = runner.invoke(app, ["compare", "1", "--protocol", "abab", "--db", url])
    assert bad.exit_code != 0


def test_machines_that_measured_different_weights_are_named(tmp_path):
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()
        p = store.put_protocol(sha256="ef" * 32, name="pinned", canonical_json="{}")
        same = [verdict("faithfulness", "packet", True, 0.0)]
        for host, digest in (("lab-a", "a" * 64), ("lab-b", "b" * 64)):
            sid = screened(store, p, host=host, node=host, verdicts=same)
            store.set_attempt_evidence(store.latest_attempt(sid).id, model_sha256=digest, signer_key_id=None)
    out = CliRunner().invoke(app, ["compare", "--protocol", "pinned", "--db", url])
    assert out.exit_code == 0 and "measured different weights" in out.output and "aaaaaaaaaaaa" in out.output
    data = json.loads(CliRunner().invoke(app, ["compare", "--protocol", "pinned", "--db", url, "--json"]).stdout)
    assert {c["model_sha256"] for c in data["columns"]} == {"a" * 64, "b" * 64}


def test_machines_are_counted_by_host_not_by_ray_node(tmp_path):
    # An embedded Ray gets a new node id per run: three screens on one host are one machine.
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()
        p = store.put_protocol(sha256="ab" * 32, name="seed-v040", canonical_json="{}")
        same = [verdict("faithfulness", "packet", True, 0.0)]
        for node in ("9fd8380a2b396d8f", "64158e22aa", "8523b13ebb"):
            screened(store, p, host="vm", node=node, verdicts=same)
    out = CliRunner().invoke(app, ["compare", "--protocol", "abab", "--db", url])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0] == "protocol seed-v040 (abababababab): 3 screen(s) on 1 machine(s) (vm)"
    data = json.loads(CliRunner().invoke(app, ["compare", "--protocol", "abab", "--db", url, "--json"]).output)
    assert data["hosts"] == ["vm"]


def test_an_audit_names_its_host_by_name_and_a_ray_node_beside_it():
    from packbench.service.audit import host_and_node

    assert host_and_node("vm", "vm") == "vm"
    assert host_and_node("vm", "9fd8380a2b396d8f") == "vm (Ray node 9fd8380a)"
