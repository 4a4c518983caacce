"""MoE through the condition interface: the worker loads an MoE checkpoint, runs the same
condition runtimes (resident, dense-stream, packet, phase-switched) at expert granularity, and
every record is bit-identical to dense-stream with its expert ledger; submit's check refuses a
policy that does not fit the family and an allowance too small for one layer's routed experts."""

import numpy as np
import pytest
import torch

from packbench.core.errors import ProtocolError
from packbench.core.plan import plan, prompts
from packbench.core.protocol import freeze
from packbench.engine.moe.policies import ExpertPacketPolicy, ExpertPhaseSwitched
from packbench.engine.moe.synth import synth_moe
from packbench.engine.worker import Worker
from packbench.service.submit import check_family


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return synth_moe(tmp_path_factory.mktemp("moe") / "qwen3", shape="qwen3-moe-tiny", seed=2, dtype="bfloat16")


def raw(path, **changes):
    return {"name": "moe", "model": {"path": str(path)}, "dtype": "bfloat16",
            "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 16, "continuation_tokens": 4,
            "conditions": [{"policy": "dense-stream"}, {"policy": "resident"}, {"policy": "packet"},
                           {"name": "packet-host", "policy": "packet", "params": {"gather": "host"}},
                           {"policy": "phase-switched"}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}, **changes}


def test_the_worker_runs_every_expert_policy_exactly(moe_dir):
    b = freeze(raw(moe_dir)).body
    check_family(freeze(raw(moe_dir)))  # fits: nothing raised
    worker = Worker(device="cpu")
    start = worker.load(b, str(moe_dir))
    assert start["host_outgoing_bytes"] == worker.model.host.host_bytes > 0  # the experts stay on the host
    ids = prompts(b, vocab=start["vocab"])
    records = {}
    for e in plan(b):
        records.setdefault(e["condition"], []).append(worker.run(e, ids[e["prompt"]]))
        if e["condition"].startswith("packet"):
            assert type(worker.model.slot.policy) is ExpertPacketPolicy  # either gather: the expert packet
        if e["condition"] == "phase-switched":
            assert type(worker.model.slot.policy) is ExpertPhaseSwitched
    ref = records["dense-stream"][0]
    assert ref["status"] == "ok", ref.get("error")
    for name, runs in records.items():
        for r in runs:
            assert r["status"] == "ok", (name, r.get("error"))
            assert np.array_equal(r["logits"], ref["logits"]) and r["tokens"] == ref["tokens"], name
    expert_bytes = worker.model.host.expert_bytes
    for label, index in (("packet", 0), ("packet-host", 8)):  # a new protocol's packet gathers on the device
        for call in records[label][0]["calls"]:
            assert call["h2d_weight_bytes"] == [m * expert_bytes for m in call["rows_copied"]]
            assert call["h2d_index_bytes"] == [index * m for m in call["rows_copied"]]


def test_submit_refuses_an_opt_policy(moe_dir):
    with pytest.raises(ProtocolError, match=r"conditions\[1\].policy.*'row-retention' does not fit.*qwen3_moe MoE"):
        check_family(freeze(raw(moe_dir, conditions=[{"policy": "dense-stream"},
                                                     {"policy": "row-retention", "params": {"rows_per_layer": 8}}])))


def _real_config_dir(tmp_path, shape: str):
    """config.json alone: submit's checks read no weights."""
    import json

    from packbench.engine.moe.synth import moe_config

    d = tmp_path / shape
    d.mkdir()
    (d / "config.json").write_text(json.dumps(moe_config(shape, dtype="float16")))
    return d


def test_allowance_must_hold_the_device_part_and_one_layers_routed_experts(tmp_path):
    """Qwen3-30B-A3B in fp16: the device part is 2.87 GiB (embeddings and lm_head of a 151936-token
    vocabulary, attention, routers); 2 GiB cannot hold it, 24 GiB holds it and every buffer."""
    d = _real_config_dir(tmp_path, "qwen3-30b-a3b")
    body = dict(raw(d), dtype="float16", conditions=[{"policy": "dense-stream"}, {"policy": "packet"}])
    with pytest.raises(ProtocolError, match=r"`allowance_mib`: 2048 MiB cannot hold .* one layer's routed experts"):
        check_family(freeze({**body, "allowance_mib": 2048}))
    check_family(freeze({**body, "allowance_mib": 24 * 1024}))
    # resident holds every layer's experts (48 x 1.125 GiB): refused at 24 GiB unless unbounded.
    with pytest.raises(ProtocolError, match="condition 'resident' \\(resident\\)"):
        check_family(freeze({**body, "allowance_mib": 24 * 1024,
                             "conditions": [{"policy": "dense-stream"}, {"policy": "resident"}]}))
    check_family(freeze({**body, "allowance_mib": 24 * 1024, "conditions": [
        {"policy": "dense-stream"}, {"policy": "resident", "params": {"allowance": "unbounded"}}]}))


def test_protocol_validate_prints_the_refusal_in_one_line_exit_2(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    d = _real_config_dir(tmp_path, "mixtral-8x7b")
    body = dict(raw(d), dtype="float16", allowance_mib=1024, conditions=[{"policy": "dense-stream"}])
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(body))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate", str(f)], capture_output=True,
                       text=True, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "allowance_mib" in r.stderr and "Traceback" not in r.stderr


def test_a_broken_moe_config_is_one_line_naming_the_key(tmp_path):
    import json

    from packbench.core.errors import CheckpointError
    from packbench.engine.config import read_config
    from packbench.engine.moe.synth import moe_config

    d = tmp_path / "broken"
    d.mkdir()
    config = moe_config("olmoe-tiny")
    del config["num_experts_per_tok"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_experts_per_tok is None, not a positive integer; fix config.json"):
        read_config(d)
    config = moe_config("olmoe-tiny")  # the published name of the expert count, or transformers 5.2x's
    config["num_local_experts"] = config.pop("num_experts")
    (d / "config.json").write_text(json.dumps(config))
    assert read_config(d)["num_local_experts"] == 16


def test_the_worker_generates_a_synthetic_moe_model_from_the_protocol(tmp_path):
    """model.synth naming an MoE shape: the worker draws it once into its model cache (the spec's
    folder), with the stated layers and routing profile, and runs the expert policies on it
    exactly (would catch the worker handing an MoE spec to OPT's synthesis, or ignoring layers)."""
    import json

    from packbench.engine.worker import model_dir_for

    body = dict(raw("unused"), model={"synth": {"shape": "olmoe-tiny", "dtype": "bfloat16", "seed": 5, "layers": 2,
                                                "routing": "mixtral"}},
                conditions=[{"policy": "dense-stream"}, {"policy": "packet"}])
    frozen = freeze(body)
    b = frozen.body
    d = model_dir_for(frozen.protocol, None, cache=tmp_path)
    recipe = json.loads((d / "packbench_synth.json").read_text())
    assert (recipe["shape"], recipe["layers"], recipe["profile"], recipe["seed"]) == ("olmoe-tiny", 2, "mixtral", 5)
    assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 2
    assert model_dir_for(frozen.protocol, None, cache=tmp_path) == d  # generated once, then reused
    worker = Worker(device="cpu")
    start = worker.load(b, None, model_cache=str(tmp_path))
    ids = prompts(b, vocab=start["vocab"])
    records = [worker.run(e, ids[e["prompt"]]) for e in plan(b)]
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    assert all(np.array_equal(r["logits"], records[0]["logits"]) for r in records)


def held_tensors(model) -> list:
    """What the MoE model's experts modules still reference (a policy's device tensors, on a GPU)."""
    return [t for e in model.experts_modules if e is not None for t in (e.gate_up_proj, e.down_proj) if t is not None]


def test_a_competitor_and_a_failed_episode_find_the_loader_policy_released(moe_dir):
    """Bug caught (Mixtral-8x7B on an H100: accelerate given less than its allowance, then a map
    with nothing on the GPU): handing the device to a competitor, and cleaning up after a failed
    episode, deactivated the loader policy but left the experts modules referencing its last
    tensors (on a GPU: its device buffers, counted as held and taken off the competitor's
    max_memory). Now both release it as switching policies does: no tensor referenced."""
    pytest.importorskip("accelerate")
    body = raw(moe_dir, conditions=[{"policy": "dense-stream"}, {"policy": "packet"}, {"policy": "accelerate"}])
    b = freeze(body).body
    worker = Worker(device="cpu")
    start = worker.load(b, str(moe_dir))
    ids = prompts(b, vocab=start["vocab"])
    entries = {e["condition"]: e for e in plan(b)}
    assert worker.run(entries["packet"], ids[0])["status"] == "ok"
    assert held_tensors(worker.model)  # a loader episode leaves its last layer's experts referenced
    assert worker.run(entries["accelerate"], ids[0])["status"] == "ok"
    assert worker.model.slot.policy is None and held_tensors(worker.model) == []
    assert worker.run(entries["packet"], ids[0])["status"] == "ok" and held_tensors(worker.model)

    def fails(*args, **kwargs):
        raise RuntimeError("an episode that fails mid-call")

    worker.model.forward = fails
    record = worker.run(entries["packet"], ids[0])
    assert record["status"] == "failed" and "an episode that fails mid-call" in record["error"]
    assert worker.model.slot.policy is None and held_tensors(worker.model) == []
