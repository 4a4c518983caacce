"""Expert caches and forecasts through the condition interface: the worker runs `expert-cache`
and `expert-forecast` conditions, bit-identical to dense-stream, each record carrying its
`experts` section (hit rate beside Belady's, replayed by the auditor's check); the schema and
submit's check refuse, in one line with exit 2, what cannot run."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cpu_screen import archive_screen
from packbench.cli.query import expert_cache_table_rows
from packbench.cli.report_page import expert_cache_section
from packbench.core.audit import audit_archive
from packbench.core.errors import ProtocolError
from packbench.core.expert_cache import figure_problems
from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.core.report import expert_cache_rows, read_screen
from packbench.engine.moe.synth import moe_config, synth_moe
from packbench.engine.worker import Worker
from packbench.service.submit import check_family

ROOT = Path(__file__).resolve().parents[2]
CONDITIONS = [{"policy": "dense-stream"},
              {"name": "lru4", "policy": "expert-cache", "params": {"capacity": 4}},
              {"name": "lfu4", "policy": "expert-cache", "params": {"capacity": 4, "rule": "lfu"}},
              {"policy": "expert-forecast"},
              {"name": "lru4-forecast", "policy": "expert-cache", "params": {"capacity": 4, "forecast": "on"}}]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return synth_moe(tmp_path_factory.mktemp("moe") / "olmoe", shape="olmoe-tiny", seed=2, dtype="float32")


def raw(path, **changes):
    return {"name": "moe-cache", "model": {"path": str(path)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 16, "continuation_tokens": 5,
            "conditions": CONDITIONS, "reference": "dense-stream", "warmups": 1, "allowance_mib": 64,
            "gates": {"faithfulness": {}}, **changes}


def test_the_worker_runs_caches_and_forecasts_exactly_and_records_their_figures(moe_dir, tmp_path):
    frozen = freeze(raw(moe_dir))
    check_family(frozen)  # fits: nothing raised
    path = tmp_path / "screen.zip"
    _, episodes, verdicts = archive_screen(frozen, moe_dir, path)
    records = {}
    for e in episodes:
        records.setdefault(e["condition"], []).append(e)
    ref = records["dense-stream"][0]
    assert "experts" not in ref  # only a cache or forecast has the section
    for name in ("lru4", "lfu4", "expert-forecast", "lru4-forecast"):
        r = records[name][0]
        assert r["status"] == "ok", (name, r.get("error"))
        assert np.array_equal(r["logits"], ref["logits"]) and r["tokens"] == ref["tokens"], name
        x = r["experts"]
        assert x["routed"] == x["hits"] + x["misses"] == sum(sum(c["active_rows"]) for c in r["calls"])
        assert x["hit_rate"] == x["hits"] / x["routed"] and x["belady_rate"] == x["belady_hits"] / x["routed"]
        assert x["belady_hits"] >= x["hits"]  # the oracle bounds every cache
        assert x["wasted"] == r["rows_wasted"]  # the ledger's waste is the forecast's
        assert figure_problems(json.loads(json.dumps(x)), r["calls"]) == []
    assert records["expert-forecast"][0]["experts"]["hits"] == 0 and records["expert-forecast"][0]["experts"]["prefetched"] > 0
    assert all(v["passed"] for v in verdicts if v["gate"] == "faithfulness")
    # The auditor replays every experts section from the archive and agrees.
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]
    # A tampered count is caught by the replay (the auditor's check), and so is a ledger that
    # disagrees with the counted waste.
    x = copy.deepcopy(records["lru4"][0]["experts"])
    x["hits"] += 1
    assert any("hits" in p for p in figure_problems(x, records["lru4"][0]["calls"]))
    calls = copy.deepcopy(records["lru4-forecast"][0]["calls"])
    calls[2]["rows_wasted"][1] += 1
    assert any("rows_wasted" in p for p in figure_problems(records["lru4-forecast"][0]["experts"], calls))
    # results and the report: each condition's hit rate beside Belady's, summed over scored episodes.
    screen = read_screen(path)
    rows = {r["condition"]: r for r in expert_cache_rows(screen)}
    assert list(rows) == ["lru4", "lfu4", "expert-forecast", "lru4-forecast"]
    scored = [e for e in records["lfu4"] if e["role"] == "scored"]
    hits, routed = sum(e["experts"]["hits"] for e in scored), sum(e["experts"]["routed"] for e in scored)
    belady = sum(e["experts"]["belady_hits"] for e in scored)
    assert (rows["lfu4"]["hit_rate"], rows["lfu4"]["belady_rate"]) == (hits / routed, belady / routed)
    assert rows["lfu4"]["cache"] == "4 lfu" and rows["expert-forecast"]["cache"] == "no cache + forecast"
    table = expert_cache_table_rows(list(rows.values()))
    assert table[1]["hit rate / Belady"] == f"{100 * hits / routed:.1f}% / {100 * belady / routed:.1f}%"
    assert "Belady" in expert_cache_section(screen) and "lru4-forecast" in expert_cache_section(screen)
    # prefetched / used / wasted count every call, the prefill's included (the page said nothing,
    # beside hit rates given for all calls and decode calls apart)
    assert rows["lru4-forecast"]["prefetched"] == sum(e["experts"]["prefetched"] for e in records["lru4-forecast"]
                                                      if e["role"] == "scored")
    assert "counted over every call, the prefill's included" in expert_cache_section(screen)


def _validate(tmp_path, body, *command: str) -> subprocess.CompletedProcess:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(body))
    return subprocess.run([sys.executable, "-m", "packbench", "protocol", *(command or ("validate",)), str(f),
                           *(("--shape", "opt-125m") if command == ("plan",) else ())],
                          capture_output=True, text=True, cwd=ROOT)


def _config_dir(tmp_path, shape: str) -> Path:
    d = tmp_path / shape
    d.mkdir()
    (d / "config.json").write_text(json.dumps(moe_config(shape, dtype="float16")))
    return d


def test_refusals_are_one_line_exit_2(tmp_path):
    """Each refusal names its field and the fix, exit 2, no traceback (catches a refusal that
    reaches the worker, or a traceback)."""
    mixtral = _config_dir(tmp_path, "mixtral-8x7b")  # 8 experts of 336 MiB in fp16, 32 layers
    base = dict(raw(mixtral), dtype="float16", allowance_mib=24 * 1024)
    cases = [
        (dict(base, conditions=[{"policy": "dense-stream"},
                                {"policy": "expert-cache", "params": {"capacity": -1}}]),
         "conditions[1].params.capacity"),
        (dict(base, conditions=[{"policy": "dense-stream"},
                                {"policy": "expert-cache", "params": {"capacity": 9}}]),
         "give a capacity from 0 to 8"),
        # 2 x 32 x 336 MiB = 21 GiB of slots, beside the device part and a workspace: over 24 GiB.
        (dict(base, conditions=[{"policy": "dense-stream"},
                                {"policy": "expert-cache", "params": {"capacity": 2}}]),
         "lower capacity or raise allowance_mib"),
        (dict(base, model={"synth": {"shape": "opt-125m", "dtype": "float16", "seed": 0}},
              conditions=[{"policy": "dense-stream"}, {"policy": "expert-forecast"}]),
         "does not fit the synthetic opt-125m shape, an OPT model"),
    ]
    # `protocol plan --shape` of an OPT shape, the checkpoint not here: the cache cannot be planned.
    plan_case = (dict(base, model={"path": str(tmp_path / "absent")},
                      conditions=[{"policy": "dense-stream"}, {"policy": "expert-cache", "params": {"capacity": 1}}]),
                 "plan where the checkpoint is")
    for (body, words), command in [(c, ()) for c in cases] + [(plan_case, ("plan",))]:
        r = _validate(tmp_path, body, *command)
        assert r.returncode == 2, (words, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr, (words, r.stderr)


def test_submit_refuses_a_cache_on_an_opt_checkpoint_and_fits_one_that_holds(tmp_path):
    from packbench.engine.synth import opt_config

    opt = tmp_path / "opt"  # config.json alone: submit's checks read no weights
    opt.mkdir()
    (opt / "config.json").write_text(json.dumps(opt_config("opt-125m", "float16")))
    body = dict(raw(opt), dtype="float16", conditions=[{"policy": "dense-stream"},
                                                       {"policy": "expert-cache", "params": {"capacity": 1}}])
    with pytest.raises(ProtocolError, match=r"conditions\[1\].policy.*.expert-cache. does not fit checkpoint .*, an OPT model"):
        check_family(freeze(body))
    mixtral = _config_dir(tmp_path, "mixtral-8x7b")
    # 1 x 32 x 336 MiB = 10.5 GiB of slots fits 24 GiB with the device part and one workspace.
    check_family(freeze(dict(raw(mixtral), dtype="float16", allowance_mib=24 * 1024, conditions=[
        {"policy": "dense-stream"}, {"policy": "expert-cache", "params": {"capacity": 1, "forecast": "on"}}])))


def test_separate_passes_start_each_pass_from_an_empty_cache(moe_dir):
    """With `passes: separate` the recording pass rebuilds the policy (an empty cache, no pending
    forecast): its logits equal the timing pass's and its figures replay clean (catches a cache
    that carries the timing pass's state into the recording pass, or loses its parameters)."""
    b = freeze(raw(moe_dir, passes="separate", conditions=[CONDITIONS[0], CONDITIONS[4]])).body
    worker = Worker(device="cpu")
    start = worker.load(b, str(moe_dir))
    ids = prompts(b, vocab=start["vocab"])
    records = {e["condition"]: worker.run(e, ids[e["prompt"]]) for e in plan(b)}
    r, ref = records["lru4-forecast"], records["dense-stream"]
    assert r["status"] == "ok", r.get("error")
    assert np.array_equal(r["logits"], ref["logits"])
    assert worker.model.slot.policy.capacity == 4 and worker.model.slot.policy.forecast
    assert r["experts"]["counted"][0][0]["hits"] == 0  # the recording pass's prefill met an empty cache
    assert figure_problems(r["experts"], r["calls"]) == []


def test_without_recording_the_figures_stand_on_the_routing_alone(moe_dir, tmp_path):
    """`recording: false` leaves the per-layer ledger empty; the experts section is still the replay
    of its routing and the auditor agrees (catches an audit that compares with counts never made)."""
    frozen = freeze(raw(moe_dir, recording=False, conditions=[CONDITIONS[0], CONDITIONS[4]],
                        gates={"faithfulness": {}}))
    path = tmp_path / "screen.zip"
    _, episodes, _ = archive_screen(frozen, moe_dir, path)
    r = next(e for e in episodes if e["condition"] == "lru4-forecast")
    assert r["status"] == "ok" and r["calls"][0]["active_rows"][0] is None
    assert r["experts"]["routed"] > 0 and figure_problems(r["experts"], r["calls"]) == []
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]


def test_a_moe_screens_activity_figures_count_experts_not_neurons(moe_dir, tmp_path):
    """Catches the report labelling an MoE screen's activity "active fraction of 64 neurons" (the
    values were fractions of experts): a model.path checkpoint's start record says what a row is,
    and every activity series carries the word."""
    from packbench.core import report as data

    path = tmp_path / "screen.zip"
    archive_screen(freeze(raw(moe_dir, conditions=[CONDITIONS[0], {"policy": "packet"}])), moe_dir, path)
    s = read_screen(path)
    assert s.start["unit"] == "expert" and data.unit_name(s) == "experts"
    experts = json.loads((moe_dir / "config.json").read_text())["num_experts"]
    assert data.neurons_per_layer(s) == experts
    for series in (data.active_heatmap(s), data.union_sparsity(s), data.workload_by_layer(s)):
        assert series["unit"] == "experts"
    # The page's activity heading promised "against the profile and real OPT" on an MoE screen,
    # which has neither an OPT profile nor a real-OPT figure to be set against.
    from packbench.cli.report_page import plots_section

    page = plots_section(s)
    assert '<h2 id="workload">Activity by layer</h2>' in page and "real OPT</h2>" not in page
