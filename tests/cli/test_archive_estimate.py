"""The archive a screen will write, estimated from its plan (core/estimate.py archive_bytes), against
a real CPU screen's archive; the one-line warning `protocol validate`, `plan` and `submit` print
when it will be over the audit's bound (docs/archive.md, "Bounds"), never a refusal."""

import json
import zipfile

import pytest
import yaml
from typer.testing import CliRunner

from cpu_screen import archive_screen  # tests/cpu_screen.py
from packbench.cli.main import app
from packbench.core.archive import reader as archive_reader
from packbench.core.archive.bounds import mib_to_admit
from packbench.core.estimate import archive_bytes, archive_warning
from packbench.core.protocol import freeze

# The estimate is within this factor of the real archive (both its members' declared bytes,
# what the reader's total bound counts, and the file); its logits part is exact.
FACTOR = 1.15


def raw(tiny, *, batch: int) -> dict:
    """Three conditions, one of them approximate (teacher-forced logits), at `batch`."""
    return {"name": "archive-size", "model": {"path": str(tiny)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": 4}}, "prefix_tokens": 16, "continuation_tokens": 8,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"},
                           {"policy": "quantized", "params": {"method": "int8-weight-only"}}],
            "reference": "dense-stream", "allowance_mib": 4800, "gates": {"faithfulness": {"tolerance": 0.0}},
            **({"batch": batch} if batch > 1 else {})}


@pytest.mark.parametrize("batch", [1, 2])
def test_the_estimate_is_close_to_a_real_cpu_screens_archive(tiny, tmp_path, batch):
    frozen = freeze(raw(tiny, batch=batch))
    path = tmp_path / "screen.zip"
    archive_screen(frozen, tiny, path)
    est = archive_bytes(frozen.protocol, vocab=512)  # the tiny shape's vocabulary
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    logits = sum(i.file_size for i in infos if i.filename.startswith(("logits/", "forced/")))
    declared = sum(i.file_size for i in infos)
    # Exact: (batch, calls, vocab) float32 and a 128-byte .npy header per episode, teacher-forced
    # logits for every approximate episode. Catches a batch, a call count or forced logits left out.
    assert est["logits_bytes"] == logits, (est, logits)
    assert est["episode_logits_bytes"] == batch * 8 * 512 * 4 + 128
    assert (est["episodes"], est["forced_episodes"]) == (15, 5)
    for real in (declared, path.stat().st_size):
        assert real / FACTOR <= est["bytes"] <= real * FACTOR, (est["bytes"], real)


def test_the_warning_starts_just_past_the_bound_and_names_the_estimate_and_the_fixes(monkeypatch):
    est = {"bytes": 10 << 20, "logits_bytes": 0, "episodes": 3, "forced_episodes": 0, "episode_logits_bytes": 1 << 20}
    monkeypatch.setattr(archive_reader, "MAX_ARCHIVE_BYTES", 64 << 20)
    monkeypatch.setattr(archive_reader, "MAX_TOTAL_BYTES", 10 << 20)  # the smaller bound is the audit's
    assert archive_warning(est) is None  # exactly at the bound: the audit reads it
    line = archive_warning({**est, "bytes": (10 << 20) + 1})
    assert line is not None and "\n" not in line
    assert line.startswith("this screen's archive will be about 10 MiB (3 episodes x 1.0 MiB of float32 logits), "
                           "over the audit bound of 10 MiB"), line
    assert "fewer prompts, episodes or tokens" in line and "`packbench audit SCREEN --max-mib 11`" in line


def test_the_h200_batch_32_screen_would_have_been_warned_about():
    """bench/peers_device.sh's batch-32 screen of OPT-2.7B (32 prompts x 64 + 16 tokens, five
    conditions, one warmup each: 33 episodes a condition) wrote a 10,193,506,778-byte archive that
    no audit could read; nothing warned before it ran. Its file is 99 episodes' logits of this
    size and 745,562 bytes more: episodes that failed store none, so the plan's estimate is an
    upper one."""
    body = {"name": "b32", "model": {"synth": {"shape": "opt-2.7b", "dtype": "float16", "seed": 0}},
            "dtype": "float16", "prompts": {"generator": {"seed": 0, "count": 32}}, "prefix_tokens": 64,
            "continuation_tokens": 16, "batch": 32, "warmups": 1, "reference": "dense-stream", "allowance_mib": 8192,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet", "params": {"gather": "device"}},
                           {"policy": "phase-switched", "params": {"gather": "device"}}, {"policy": "accelerate"},
                           {"policy": "zero-inference"}],
            "gates": {"faithfulness": {"tolerance": 0.0}}}
    est = archive_bytes(freeze(body).protocol, vocab=50272)
    # Catches logits counted per prompt instead of per batch, or without the calls.
    assert est["episode_logits_bytes"] == 32 * 16 * 50272 * 4 + 128 == 102_957_184
    assert 10_193_506_778 - 99 * 102_957_184 == 745_562
    assert est["episodes"] == 165 and est["bytes"] >= 10_193_506_778
    line = archive_warning(est)
    assert line is not None and f"--max-mib {mib_to_admit(est['bytes'])}" in line


@pytest.fixture()
def over(tmp_path, tiny, monkeypatch):
    """A protocol file whose archive is over the (lowered) bound."""
    monkeypatch.setattr(archive_reader, "MAX_TOTAL_BYTES", 100_000)  # the tiny screen's is ~350 KB
    path = tmp_path / "p.yaml"
    body = raw(tiny, batch=1)  # its approximate condition judged, so the archive's is the one warning
    body["gates"]["fidelity"] = {"condition": "quantized", "min_top1": 0.5}
    path.write_text(yaml.safe_dump(body))
    return path


def test_validate_and_plan_warn_in_one_line_and_still_accept(over, tmp_path, monkeypatch):
    # Catches a refusal (the user may audit with --max-mib) and a warning lost from stdout's JSON.
    r = CliRunner().invoke(app, ["protocol", "validate", str(over)])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    [warning] = r.stderr.strip().splitlines()
    assert warning.startswith("warning: this screen's archive will be about ") and "--max-mib" in warning
    assert r.stdout.startswith("valid: ")
    doc = json.loads(CliRunner().invoke(app, ["protocol", "validate", str(over), "--json"]).stdout)
    assert doc["valid"] is True and doc["warning"] == warning[len("warning: "):]
    r = CliRunner().invoke(app, ["protocol", "plan", str(over), "--device", "cpu", "--db", f"sqlite:///{tmp_path / 'n.db'}"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert r.stderr.strip() == warning and "\narchive: about " in r.stdout
    planned = json.loads(CliRunner().invoke(app, ["protocol", "plan", str(over), "--json", "--device", "cpu",
                                                  "--db", f"sqlite:///{tmp_path / 'n.db'}"]).stdout)
    assert planned["archive"]["warning"] == doc["warning"] and planned["archive"]["episodes"] == 15
    assert CliRunner().invoke(app, ["db", "upgrade", "--db", f"sqlite:///{tmp_path / 's.db'}"]).exit_code == 0
    r = CliRunner().invoke(app, ["submit", str(over), "--db", f"sqlite:///{tmp_path / 's.db'}", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout) == {"queued": [1]}, (r.stdout, r.stderr)
    assert r.stderr.strip() == warning
    monkeypatch.setattr(archive_reader, "MAX_TOTAL_BYTES", 10 << 20)  # within the bound: no line at all
    r = CliRunner().invoke(app, ["protocol", "validate", str(over)])
    assert r.exit_code == 0 and r.stderr == "", r.stderr


def test_the_same_batch_32_screen_scoring_one_batch_fits_the_bound():
    """`scored_prompts: 1` (schema 10): the batch-32 screen above scores one batch of 32 prompts a
    condition instead of 32 overlapping ones: 10 episodes (5 warmups, 5 scored). At 16 tokens that
    is still 982 MiB, over the audit's 640 MiB; at the 8 tokens bench/peers_device.sh's batched
    screens now decode it fits, without a warning (catches the plan still scoring every prompt)."""
    body = {"name": "b32", "model": {"synth": {"shape": "opt-2.7b", "dtype": "float16", "seed": 0}},
            "dtype": "float16", "prompts": {"generator": {"seed": 0, "count": 32}}, "prefix_tokens": 64,
            "continuation_tokens": 8, "batch": 32, "scored_prompts": 1, "warmups": 1, "reference": "dense-stream",
            "allowance_mib": 8192,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet", "params": {"gather": "device"}},
                           {"policy": "phase-switched", "params": {"gather": "device"}}, {"policy": "accelerate"},
                           {"policy": "zero-inference"}],
            "gates": {"faithfulness": {"tolerance": 0.0}}}
    est = archive_bytes(freeze(body).protocol, vocab=50272)
    assert est["episodes"] == 10 and est["episode_logits_bytes"] == 32 * 8 * 50272 * 4 + 128
    assert archive_warning(est) is None
    assert archive_warning(archive_bytes(freeze({**body, "continuation_tokens": 16}).protocol, vocab=50272))


@pytest.mark.parametrize("batch, warned", [(64, True), (32, False)])
def test_submit_warns_where_the_loaders_leave_no_room_for_a_context(tmp_path, batch, warned):
    """OPT-13B under 20480 MiB, 64 + 5 tokens: at batch 64 packbench's loaders (16,516 MiB) and the
    KV cache (3,450 MiB) leave 514 MiB, less than a CUDA context, and every such episode ran out of
    memory on an H100; at batch 32 (1,725 MiB of KV) they ran. Submit warns at 64 only, as the plan
    does, and queues the screen either way (the context is the worker's to measure)."""
    body = {"name": f"b{batch}", "model": {"synth": {"shape": "opt-13b", "dtype": "float16", "seed": 0}},
            "dtype": "float16", "prompts": {"generator": {"seed": 0, "count": batch}}, "prefix_tokens": 64,
            "continuation_tokens": 5, "batch": batch, "scored_prompts": 1, "warmups": 1, "reference": "dense-stream",
            "allowance_mib": 20480, "conditions": [{"policy": "dense-stream"}, {"policy": "packet"},
                                                   {"policy": "zero-inference"}],
            "gates": {"faithfulness": {}}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(body))
    db = f"sqlite:///{tmp_path / 's.db'}"
    assert CliRunner().invoke(app, ["db", "upgrade", "--db", db]).exit_code == 0
    r = CliRunner().invoke(app, ["submit", str(path), "--db", db, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout) == {"queued": [1]}, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if "hold" in line]
    if warned:
        assert lines == ["warning: dense-stream, packet hold 16,516 MiB on the device (every weight but the outgoing "
                         "rows) and the KV cache of batch 64, 3,450 MiB: 514 MiB of the 20,480 MiB allowance is left "
                         "for the CUDA context (about 750 MiB on an H100 or H200) and the prefill's activations (about "
                         "1,192 MiB), so expect them to run out of memory; raise allowance_mib or lower the batch"], r.stderr
    else:
        assert lines == [], r.stderr
