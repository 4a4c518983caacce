"""Schema 3 (issue 11): a new protocol's `packet` gathers on the device; every protocol frozen
before it keeps its body, its hash and what it runs."""

import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml

from packbench.core.canonical import canonical_json, sha256_hex
from packbench.core.errors import ProtocolError
from packbench.core.protocol import SCHEMA_VERSION, SCHEMAS, expand, freeze, load, validate
from packbench.core.registry import POLICY_PARAMS, SCHEMA3_DEFAULTS, ChoiceParam

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"

# Regression anchors, computed with the code before schema 3 existed (commit 3cfbd6a): for each
# frozen body, (sha256 of the body, sha256 of the canonical full schema-2 form the engine reads).
ARCHIVED = {
    "quickstart-v1": ("af0446fdbcc667969ddfcb1db6637b334f64d5aa5aab5267597c95ef119dc346",
                      "5aeaf3ea689501fe2bacd63fb45896682f85b7f3fc82bb16a09d3c4f9f578b55"),
    "negative-v1": ("e81d5fa25f54a39b34ddab7e25e4c195ebb02eb35f3b551fd29976c85d8c0f5a",
                    "c3b46cea4cbf03bc89a6ef4c0e777d18828652bc8ae2845d9881be3694439b5d"),
    "gates-v2": ("487a14b9f30f077aba7af645134fe3a9f24dce04c9575b0cd1213be59fef738f",
                 "487a14b9f30f077aba7af645134fe3a9f24dce04c9575b0cd1213be59fef738f"),
}
# bench/every_policy.sh's screen (schema 2, `{policy: packet}` beside a named device gather),
# frozen before schema 3: a schema-2 body is its own full form.
EVERY_POLICY_SHA256 = "509da3200b28a1aac68f0209f4815440bd97264d857c3b47d86b0dd2d2cddb31"
QUICKSTART_SHA256 = "a5e99a22153b3b16b0bc19775063c0b8c27cf0ad76952a072d4b438d5a539fdb"  # schema 1, as 0.1 froze it


def quickstart(**changes) -> dict:
    """protocols/quickstart.yaml (schema 2, one `packet` condition) with `changes` at top level."""
    data = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}  # schema=None: written without `schema:`


def packet(frozen) -> tuple[dict, dict]:
    """(frozen params, params it runs with) of the condition named packet (schema 1 has no params)."""
    return dict(frozen.body["conditions"][1].get("params", {})), expand(frozen.body).condition("packet").resolved_params


def archived_body(name: str) -> dict:
    with zipfile.ZipFile(DATA / f"{name}.zip") as z:
        return json.loads(z.read("protocol.json"))


# ----------------------------------------------------------------------------- what packet means


def test_a_protocol_without_schema_is_schema3_and_packet_gathers_on_the_device():
    assert SCHEMA_VERSION == 11 and SCHEMAS == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
    new = freeze(quickstart(schema=None))
    assert new.body["schema"] == 2  # schema 1 has no gather; schema 3 is never frozen (below)
    assert packet(new) == ({"gather": "device"}, {"gather": "device"})
    assert new.sha256 == freeze(quickstart(schema=3)).sha256  # omitted schema == the newest


@pytest.mark.parametrize("schema", [1, 2])
def test_in_schema_1_and_2_packet_without_gather_is_the_host_gather(schema):
    old = freeze(quickstart(schema=schema))
    assert old.body["schema"] == 1 and old.sha256 == QUICKSTART_SHA256
    assert packet(old) == ({}, {"gather": "host"})


def test_the_host_gather_stays_available_by_name_in_schema3():
    c = {"policy": "packet", "params": {"gather": "host"}}
    host = freeze(quickstart(schema=None, conditions=[{"policy": "dense-stream"}, c]))
    assert host.body["conditions"][1]["name"] == "packet"  # the default name is still the policy's
    assert packet(host) == ({"gather": "host"}, {"gather": "host"})
    assert host.sha256 == freeze(quickstart(schema=2, conditions=[{"policy": "dense-stream"}, c])).sha256


def test_schema3_freezes_in_the_lowest_schema_that_says_it():
    explicit = [{"policy": "dense-stream"}, {"name": "packet", "policy": "packet", "params": {"gather": "device"}}]
    new = freeze(quickstart(schema=None))
    assert new.body == freeze(quickstart(schema=2, conditions=explicit)).body  # schema 2 spelled out
    # Without a packet, schema 3 says what schema 1 says: the same body and hash as packbench 0.1.
    no_packet = [{"policy": "dense-stream"}, {"policy": "resident"}]
    v3 = freeze(quickstart(schema=None, conditions=no_packet, warmups=1))
    assert v3.body["schema"] == 1 and v3.body == freeze(quickstart(schema=1, conditions=no_packet)).body


def test_freezing_and_expanding_round_trip():
    new = freeze(quickstart(schema=None))
    proto = expand(new.body)
    assert proto.sha256 == new.sha256 and proto.body_dict() == new.body and validate(new.body) == new.body
    assert validate(proto.full_dict()) == new.body and expand(proto.full_dict()) == proto
    # A mapping that says `schema: 3` is a YAML, not a frozen body: it freezes to the schema-2
    # body above, so the auditor's `validate(body) == body` refuses it as protocol.json.
    as_written = quickstart(schema=3)
    assert validate(as_written) == new.body != as_written and expand(as_written) == proto


def test_schema3_defaults_are_registry_choices_that_differ_from_the_frozen_defaults():
    for policy, defaults in SCHEMA3_DEFAULTS.items():
        for name, value in defaults.items():
            param = POLICY_PARAMS[policy][name]
            assert isinstance(param, ChoiceParam) and value in param.choices and value != param.default


# ----------------------------------------------------------------------------- old meanings hold


@pytest.mark.parametrize("name", sorted(ARCHIVED))
def test_archived_bodies_keep_their_body_hash_and_host_gather(name):
    body = archived_body(name)
    proto = expand(body)
    assert (proto.sha256, sha256_hex(canonical_json(proto.full_dict()))) == ARCHIVED[name]
    assert proto.body_dict() == body and validate(body) == body
    assert proto.condition("packet").resolved_params == {"gather": "host"}
    if name.endswith("-v1"):  # the YAML these were frozen from still freezes to them
        assert load(DATA / f"{name}.yaml").body == body


def test_every_policy_screen_keeps_its_meaning(tmp_path):
    """bench/every_policy.sh writes schema 2: `packet` is the host gather, `packet-device` the device one."""
    (tmp_path / "m13").mkdir()
    (tmp_path / "m13" / "config.json").write_text("{}")  # the function synthesises no checkpoint then
    subprocess.run(["bash", "-c", f"source {ROOT / 'bench' / 'every_policy.sh'} && every_policy_screen every-policy"],
                   cwd=tmp_path, check=True, timeout=60)
    frozen = load(tmp_path / "p.yaml")
    assert frozen.sha256 == EVERY_POLICY_SHA256
    runs = {c.name: c.resolved_params for c in frozen.protocol.conditions}
    assert runs["packet"] == {"gather": "host"} and runs["packet-device"] == {"gather": "device"}
    assert runs["early-forecast"] == {"gather": "host"}


@pytest.mark.parametrize("schema", [2, None])
def test_early_forecast_gathers_on_the_host_unless_told_in_every_schema(schema):
    """early-forecast's `gather` came after every schema: left out, it is frozen without it
    (old hashes hold) and means the host gather; `gather: device` is frozen as written."""
    def frozen(params):
        c = {"policy": "early-forecast", **({"params": params} if params is not None else {})}
        f = freeze(quickstart(schema=schema, conditions=[{"policy": "dense-stream"}, c]))
        return dict(f.body["conditions"][1].get("params", {})), expand(f.body).condition("early-forecast").resolved_params
    assert frozen(None) == ({}, {"gather": "host"})
    assert frozen({"gather": "device"}) == ({"gather": "device"}, {"gather": "device"})
    with pytest.raises(ProtocolError, match=r"conditions\[1\]\.params\.gather`: 'gpu' is not allowed; use one of host, device"):
        frozen({"gather": "gpu"})
