"""`passes` (schema 7): how an episode is measured. A protocol without it, or with `passes:
together`, freezes to the body and hash it always had; `passes: separate` freezes as schema 7 and
re-validates to itself; a bad value is one line naming the field, exit 2 through the CLI."""

from pathlib import Path

import pytest
import yaml

from packbench.core.errors import ProtocolError
from packbench.core.plan import plan
from packbench.core.protocol import expand, freeze, load, validate
from tests.core.test_protocol_schema4 import TINY, protocol

ROOT = Path(__file__).resolve().parents[2]
# What packbench froze these files to before schema 7 (main at 10482f2): they must not move.
PINNED = {
    "protocols/int8-fidelity.yaml": "3b362f82178033a01a0c668ef009887c5bb2f5c43bc0d189af28231ac3f8d9f4",
    "protocols/int8-packets.yaml": "b051f98d3aa5dd0636caa8e2a28d387d9c61986ef61ec88db4e4f13e5ef38443",
    "protocols/quickstart.yaml": "a5e99a22153b3b16b0bc19775063c0b8c27cf0ad76952a072d4b438d5a539fdb",
    "protocols/seed-v040.yaml": "f2b207f3e68c88ea7c42c71e23f952e9514f3150844e9313087190b63a1a3f56",
    "protocols/seed-v042.yaml": "a5daa0cccbb1e988bb72fa72ea101d6761db41e016de00bee6d4d42f6f9b4ca0",
    "tests/data/gates-v2.yaml": "487a14b9f30f077aba7af645134fe3a9f24dce04c9575b0cd1213be59fef738f",
    "tests/data/negative-v1.yaml": "e81d5fa25f54a39b34ddab7e25e4c195ebb02eb35f3b551fd29976c85d8c0f5a",
    "tests/data/quickstart-v1.yaml": "af0446fdbcc667969ddfcb1db6637b334f64d5aa5aab5267597c95ef119dc346",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_every_protocol_written_before_schema_7_keeps_its_hash(name):
    path = ROOT / name
    frozen = load(path)
    assert frozen.sha256 == PINNED[name]
    assert "passes" not in frozen.body and frozen.protocol.passes == "together"
    raw = yaml.safe_load(path.read_text())
    if "schema" not in raw:  # read as the newest: saying the default changes nothing
        assert freeze({**raw, "passes": "together"}, source=path).sha256 == PINNED[name]


def test_together_is_left_out_of_the_body():
    before = freeze(protocol(TINY))
    together = freeze(protocol(TINY, passes="together"))
    assert together.body == before.body and together.sha256 == before.sha256 and before.body["schema"] == 2


def test_separate_freezes_as_schema_7_and_validates_to_itself():
    frozen = freeze(protocol(TINY, passes="separate"))
    assert frozen.body["schema"] == 7 and frozen.body["passes"] == "separate"
    assert validate(frozen.body) == frozen.body
    typed = expand(frozen.body)
    assert typed.passes == "separate" and typed.separate_passes and typed.full["passes"] == "separate"
    assert frozen.sha256 != freeze(protocol(TINY)).sha256
    assert plan(frozen.body) == plan(freeze(protocol(TINY)).body)  # the plan is the same episodes
    # a protocol that freezes as schema 1 (the quickstart) says schema 7 once it separates passes
    quick = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    assert freeze({**quick, "schema": 7, "passes": "separate"}).body["schema"] == 7
    # with a batch (schema 6) or a competitor: still 7, the lowest that says both
    assert freeze(protocol(TINY, passes="separate", batch=2)).body["schema"] == 7


@pytest.mark.parametrize("changes, fragment", [
    ({"passes": "apart"}, "protocol field `passes`: 'apart' is not allowed; use one of together, separate"),
    ({"passes": True}, "protocol field `passes`: True is not allowed; use one of together, separate"),
    ({"passes": "separate", "schema": 6}, "protocol field `passes`: needs schema 7; write schema: 7 or omit `schema:`"),
    ({"passes": "together", "schema": 5}, "protocol field `passes`: needs schema 7; write schema: 7 or omit `schema:`"),
    ({"passes": "separate", "recording": False},
     "protocol field `passes`: separate needs recording: true (its recording pass writes the ledger); "
     "drop recording: false or write passes: together"),
])
def test_bad_passes_are_one_line_naming_the_field(changes, fragment):
    with pytest.raises(ProtocolError) as e:
        validate(protocol(TINY, **changes))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_bad_passes_in_one_line_exit_2(tmp_path, packbench_cli):
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(protocol(TINY, passes="twice")))
    r = packbench_cli("protocol", "validate", str(tmp_path / "p.yaml"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "protocol field `passes`: 'twice' is not allowed; use one of together, separate" in lines[0]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(protocol(TINY, passes="separate")))
    r = packbench_cli("protocol", "validate", str(tmp_path / "p.yaml"))
    # read as the newest (8), frozen in the lowest that says separate passes (7)
    assert r.returncode == 0 and "(read as schema 11, frozen as schema 7)" in r.stdout, r.stdout
    r = packbench_cli("protocol", "plan", str(tmp_path / "p.yaml"), "--db", f"sqlite:///{tmp_path / 'none.db'}")
    assert r.returncode == 0 and "passes: separate: every episode runs twice" in r.stdout, r.stdout + r.stderr
