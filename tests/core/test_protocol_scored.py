"""`scored_prompts` (schema 10): the scored episodes of each repetition start at the first N prompts.
A protocol without it freezes to the body and hash it always had; with it, it freezes as schema 10,
plans N scored episodes per condition and repetition (each batch still decodes `batch` prompts),
and every count that follows from the plan (episodes, bootstrap pairs, the archive estimate) uses N."""

import subprocess
import sys

import pytest

from packbench.core.errors import ProtocolError
from packbench.core.estimate import archive_bytes
from packbench.core.plan import plan
from packbench.core.protocol import expand, freeze, validate
from tests.core.test_protocol_schema4 import TINY, protocol


def scored(entries: list[dict]) -> list[tuple]:
    return [(e["condition"], e["prompt"], e["repetition"], tuple(e.get("prompts", ()))) for e in entries
            if e["role"] == "scored"]


def test_without_it_a_protocol_freezes_and_plans_as_it_always_did():
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 4}})
    before = freeze(raw)
    assert "scored_prompts" not in before.body and before.body["schema"] == 2
    assert expand(before.body).scored_prompts == 4
    assert len(scored(plan(before.body))) == 4 * 2  # every prompt, both conditions


def test_it_freezes_as_schema_10_changes_the_hash_and_validates_to_itself():
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 4}})
    frozen = freeze({**raw, "scored_prompts": 2})
    assert frozen.body["schema"] == 10 and frozen.body["scored_prompts"] == 2
    assert validate(frozen.body) == frozen.body and expand(frozen.body).scored_prompts == 2
    assert frozen.sha256 != freeze(raw).sha256
    # every prompt said explicitly is a different body (and hash) from saying nothing: both plan alike
    every = freeze({**raw, "scored_prompts": 4})
    assert every.sha256 != freeze(raw).sha256 and scored(plan(every.body)) == scored(plan(freeze(raw).body))


def test_a_batched_screen_scores_n_batches_each_of_batch_prompts():
    """The bug it catches: the plan loop still running over every prompt (32 overlapping batches, 32x
    the archive), or a batch shrunk to the scored prompts."""
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 8}}, batch=4, repetitions=2)
    entries = plan({**raw, "scored_prompts": 1})
    names = [c["name"] for c in raw["conditions"]]
    got = scored(entries)
    assert len(got) == 2 * 1 * len(names)  # repetitions x scored prompts x conditions
    assert {g[3] for g in got} == {(0, 1, 2, 3)}  # each scored episode decodes prompts 0..3
    assert sorted({(g[1], g[2]) for g in got}) == [(0, 0), (0, 1)]
    # warmups are unchanged by it
    assert [e for e in entries if e["role"] == "warmup"] == [e for e in plan(raw) if e["role"] == "warmup"]


def test_the_archive_estimate_counts_the_scored_episodes_only():
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 8}}, batch=8)
    full, one = archive_bytes(raw, vocab=1000), archive_bytes({**raw, "scored_prompts": 1}, vocab=1000)
    n = len(raw["conditions"])
    assert full["episodes"] == n * 8 + n and one["episodes"] == n * 1 + n  # scored + one warmup each
    assert one["episode_logits_bytes"] == full["episode_logits_bytes"]  # an episode still holds 8 sequences


@pytest.mark.parametrize("value, needle", [
    (0, "scored_prompts"), (-1, "scored_prompts"), (5, "declares 4 prompts"), (True, "scored_prompts"),
    ("2", "scored_prompts"), (2.5, "scored_prompts"), (2**63, "scored_prompts"),
])
def test_a_bad_value_is_refused_naming_the_field(value, needle):
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 4}})
    with pytest.raises(ProtocolError, match=needle):
        freeze({**raw, "scored_prompts": value})


def test_an_older_schema_cannot_say_it():
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 4}}, schema=9)
    with pytest.raises(ProtocolError, match="needs schema 10"):
        freeze({**raw, "scored_prompts": 2})


def test_the_cli_refuses_in_one_line(tmp_path):
    import yaml

    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 4}})
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({**raw, "scored_prompts": 9}))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "scored_prompts" in lines[0] and "declares 4 prompts" in lines[0]


@pytest.mark.parametrize("changes, refusal", [
    ({"scored_prompts": 0}, "`scored_prompts`: 0 is not an integer in [1, 100000]"),
    ({"scored_prompts": 100_001}, "`scored_prompts`: 100001 is not an integer in [1, 100000]"),
    ({"scored_prompts": 2, "schema": 9}, "`scored_prompts`: needs schema 10; write schema: 10 or omit `schema:`"),
])
def test_refusals_word_for_word(changes, refusal):
    """The bound is the prompt bound, checked by the field itself (not only by the comparison
    with the declared prompts), and an older schema names the one to write."""
    raw = protocol(TINY, prompts={"generator": {"seed": 0, "count": 4}})
    with pytest.raises(ProtocolError) as e:
        freeze({**raw, **changes})
    assert str(e.value) == f"protocol field {refusal}"
