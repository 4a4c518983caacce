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

from packbench.core.errors import ProtocolError
from packbench.core.expert_cache import figure_problems
from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.moe.cache import ExpertCache
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


def test_the_worker_runs_caches_and_forecasts_exactly_and_records_their_figures(moe_dir):
    frozen = freeze(raw(moe_dir))
    check_family(frozen)  # fits: nothing raised
    b = frozen.body
    worker = Worker(device="cpu")
    start = worker.load(b, str(moe_dir))
    ids = prompts(b, vocab=start["vocab"])
    records = {}
    for e in plan(b):
        records.setdefault(e["condition"], []).append(worker.run(e, ids[e["prompt"]]))
        if e["condition"] != "dense-stream":
            assert type(worker.model.slot.policy) is ExpertCache
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
        # The record's section survives the archive's JSON and replays clean.
        assert figure_problems(json.loads(json.dumps(x)), r["calls"]) == []
    assert records["expert-forecast"][0]["experts"]["hits"] == 0 and records["expert-forecast"][0]["experts"]["prefetched"] > 0
    # A tampered count is caught by the replay (the auditor's check).
    x = copy.deepcopy(records["lru4"][0]["experts"])
    x["hits"] += 1
    assert any("hits" in p for p in figure_problems(x, records["lru4"][0]["calls"]))
    calls = copy.deepcopy(records["lru4-forecast"][0]["calls"])
    calls[2]["rows_wasted"][1] += 1
    assert any("rows_wasted" in p for p in figure_problems(records["lru4-forecast"][0]["experts"], calls))


def _validate(tmp_path, body) -> subprocess.CompletedProcess:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(body))
    return subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate", str(f)], capture_output=True,
                          text=True, cwd=ROOT)


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
         "is not an MoE model"),
    ]
    for body, words in cases:
        r = _validate(tmp_path, body)
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
    with pytest.raises(ProtocolError, match=r"conditions\[1\].policy.*caches MoE experts.*not an MoE model"):
        check_family(freeze(body))
    mixtral = _config_dir(tmp_path, "mixtral-8x7b")
    # 1 x 32 x 336 MiB = 10.5 GiB of slots fits 24 GiB with the device part and one workspace.
    check_family(freeze(dict(raw(mixtral), dtype="float16", allowance_mib=24 * 1024, conditions=[
        {"policy": "dense-stream"}, {"policy": "expert-cache", "params": {"capacity": 1, "forecast": "on"}}])))
