"""Historical replay: archives written by earlier code (tests/data, see its README) are audited
by today's code and must keep their verdicts, and their audit digest, exactly.

A change here is a change of what packbench decides about results already published. If it is
intended (a new audit check, say), bump core.audit.AUDIT_VERSION, update the digests below and
say so in the release notes; never regenerate or edit the archives to make this pass.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packbench.core.archive import ArchiveReader, file_sha256
from packbench.core.audit import audit_archive
from packbench.core.protocol import load

DATA = Path(__file__).resolve().parents[1] / "data"
ROOT = DATA.parents[1]

ARCHIVES = {
    # name: (archive SHA-256, audit digest)
    "quickstart-v1": ("1525cbff65ad97c24243150a75bcf3bc3aed58bbb2dc7821eb461a108239164f",
                      "070e4bb5da8bcb7e5793e9463e514f2c9b7f66534ec7560bf2cae73adff9d205"),
    "negative-v1": ("0d2774d345c3c8b1c31f664b7439620a92b9a0adcd26f792091def3ade2fd228",
                    "aef4f06f900d534b6a72ba8bc0122574185eb12657d6bee46e6a66a005dbbf63"),
    "gates-v2": ("14c056f6a4db8bce8b454cbc1b4ac701642f415dcf982dcb3016839260902979",
                 "47fe5ea599a31abcaf59a15958864addccc73143b6ddcf9a5b24345430c8ae8c"),
}

VERDICTS = {
    # (gate, condition, phase, passed, value) as the screen stored them
    "quickstart-v1": [
        ("acquisition", "packet", "all", True, 0.1611328125),
        ("faithfulness", "dense-stream", "all", True, 0.0),
        ("faithfulness", "packet", "all", True, 0.0),
    ],
    "negative-v1": [
        ("acquisition", "packet", "all", False, 0.1492156982421875),  # the preserved negative
        ("acquisition", "resident", "all", True, 0.0),
        ("faithfulness", "dense-stream", "all", True, 0.0),
        ("faithfulness", "packet", "all", True, 0.0),
        ("faithfulness", "resident", "all", True, 0.0),
    ],
}
GATES_V2_PASSED = [
    ("acquisition", "extents", "all", False), ("acquisition", "extents", "decode", False),
    ("acquisition", "extents", "prefill", False), ("acquisition", "packet", "all", True),
    ("acquisition", "packet", "decode", True), ("acquisition", "packet", "prefill", True),
    ("acquisition", "phase-switched", "all", True), ("acquisition", "phase-switched", "decode", True),
    ("acquisition", "phase-switched", "prefill", False),
    ("capacity", "dense-stream", "all", False), ("capacity", "extents", "all", False),
    ("capacity", "packet", "all", False), ("capacity", "phase-switched", "all", False),
    ("faithfulness", "dense-stream", "all", True), ("faithfulness", "extents", "all", True),
    ("faithfulness", "packet", "all", True), ("faithfulness", "phase-switched", "all", True),
    ("resources", "dense-stream", "all", False), ("resources", "extents", "all", False),
    ("resources", "packet", "all", False), ("resources", "phase-switched", "all", False),
    ("runtime", "extents", "all", True), ("runtime", "extents", "decode", True),
    ("runtime", "packet", "all", True), ("runtime", "packet", "decode", True),
    ("runtime", "phase-switched", "all", True), ("runtime", "phase-switched", "decode", True),
    ("useful_latency", "dense-stream", "all", True), ("useful_latency", "extents", "all", True),
    ("useful_latency", "packet", "all", True), ("useful_latency", "phase-switched", "all", True),
]


@pytest.mark.parametrize("name", sorted(ARCHIVES))
def test_historical_archive_is_untouched_small_and_agrees(name):
    path = DATA / f"{name}.zip"
    sha, digest = ARCHIVES[name]
    assert file_sha256(path) == sha, "tests/data archives are never edited or regenerated"
    assert path.stat().st_size < 300_000
    report = audit_archive(path, expected_sha256=sha)
    assert report.agrees and report.problems == []
    assert report.digest == digest
    with ArchiveReader(path) as r:
        stored = r.read_json("verdicts.json")
    assert [{k: v[k] for k in report.record["verdicts"][0]} for v in stored] == report.record["verdicts"]


@pytest.mark.parametrize("name", sorted(ARCHIVES))
def test_the_documented_protocol_is_the_archived_one(name):
    with ArchiveReader(DATA / f"{name}.zip") as r:
        assert load(DATA / f"{name}.yaml").sha256 == r.manifest["protocol_sha256"]


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_schema1_archives_keep_their_verdicts(name):
    got = [(v["gate"], v["condition"], v["phase"], v["passed"], v["value"])
           for v in audit_archive(DATA / f"{name}.zip").record["verdicts"]]
    assert got == VERDICTS[name]


def test_gates_v2_archive_keeps_its_verdicts_including_its_failures():
    record = audit_archive(DATA / "gates-v2.zip").record
    assert [(v["gate"], v["condition"], v["phase"], v["passed"]) for v in record["verdicts"]] == GATES_V2_PASSED
    runtime = {(v["condition"], v["phase"]): v for v in record["verdicts"] if v["gate"] == "runtime"}
    assert all(v["interval"][0] <= v["interval"][1] and v["interval"][1] <= 2.0 for v in runtime.values())


def test_a_fresh_process_elsewhere_gives_the_same_digests(tmp_path):
    """Another interpreter (other hash seed, other folder, copies of the archives): same digests."""
    for name in ARCHIVES:
        (tmp_path / f"copy-{name}.zip").write_bytes((DATA / f"{name}.zip").read_bytes())
    code = ("import json, sys; from packbench.core.audit import audit_archive; "
            "print(json.dumps({n: audit_archive(f'copy-{n}.zip').digest for n in sys.argv[1:]}))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, *ARCHIVES], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {name: digest for name, (_, digest) in ARCHIVES.items()}
