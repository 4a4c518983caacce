"""bench.simulate_check measure on the CPU (the twin of its step in bench/simulate_check_device.sh):
the machine file it writes keeps the rates it measured, whatever file OVERHEAD_FROM names."""

import json
import sys
from pathlib import Path

import pytest

from bench import simulate_check
from packbench.engine.moe.synth import synth_moe

H100 = Path(__file__).resolve().parents[2] / "bench" / "machines" / "h100.json"


def measure(tmp_path, monkeypatch, overhead: Path):
    model = synth_moe(tmp_path / "mixtral", shape="mixtral-tiny", seed=2, dtype="float32")
    monkeypatch.setattr(sys, "argv", ["simulate_check", "measure", "--model", str(model), "--device", "cpu",
                                      "--dtype", "float32", "--prefix", "4", "--continuation", "3", "--repeats", "1",
                                      "--overhead", str(overhead), "--machine-out", str(tmp_path / "machine.json"),
                                      "--trace-out", str(tmp_path / "routing.trace")])
    simulate_check.main()
    return json.loads((tmp_path / "machine.json").read_text())


def test_a_machine_file_as_overhead_gives_its_overhead_only(tmp_path, monkeypatch):
    """OVERHEAD_FROM=bench/machines/h100.json (the one overhead term in the checkout, which is all a
    device call carries) was spread whole over the measured machine: its name, its H100 copy rate
    and its Qwen3-only compute table replaced this call's, so Mixtral's predictions had no compute."""
    h100 = json.loads(H100.read_text())
    machine = measure(tmp_path, monkeypatch, H100)
    assert machine["overhead_us"] == h100["overhead_us"]
    assert list(machine["decode_compute_ms"]) == ["mixtral-tiny:3"]
    assert machine["decode_compute_ms"]["mixtral-tiny:3"]["value"] > 0
    assert machine["name"] != h100["name"] and machine["name"].startswith("cpu-")
    assert "host memcpy" in machine["pinned_h2d_gbps"]["source"]
    assert sorted(machine) == ["decode_compute_ms", "description", "name", "overhead_us", "pinned_h2d_gbps"]


@pytest.mark.parametrize("text, fragment", [
    ('{"pinned_h2d_gbps": {"value": 50}}', "no overhead_us object in it"),
    ("not json", "not a readable JSON file"),
])
def test_an_overhead_file_without_the_term_is_refused_in_one_line_before_measuring(tmp_path, monkeypatch, text,
                                                                                    fragment):
    bad = tmp_path / "overhead.json"
    bad.write_text(text)
    with pytest.raises(SystemExit) as e:
        measure(tmp_path, monkeypatch, bad)
    assert isinstance(e.value.code, str) and "\n" not in e.value.code
    assert e.value.code.startswith(f"--overhead {bad}: ") and fragment in e.value.code
    assert not (tmp_path / "machine.json").exists() and not (tmp_path / "routing.trace").exists()


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_the_full_expert_cache_measurement_moves_zero_bytes(tmp_path, shape):
    """expert-cache's own compute (`cache_compute`) must be the cache path with zero bytes: a cache
    holding every expert of a layer, warmed by one episode of the prompt it then times. Its timed
    episodes' ledgers move nothing and every routed expert hits; a cold cache of the same kind on
    the same prompt does move bytes, so the ledger would show a copy had one happened."""
    import numpy as np
    import torch

    from packbench.engine.episode import run_episode
    from packbench.engine.moe.model import CpuFirstMoE

    model = CpuFirstMoE(synth_moe(tmp_path / shape, shape=shape, seed=3, dtype="float32"), dtype=torch.float32,
                        device=torch.device("cpu"))
    prompt = [1] + np.random.Generator(np.random.PCG64(1)).integers(4, model.vocab, size=7).tolist()
    ms, decode_calls, moved = simulate_check.cache_compute(model, prompt, continuation=4, repeats=2)
    assert moved == 0 and ms > 0 and decode_calls == 2 * 2  # 3 decode calls an episode, the first not steady
    policy = model.slot.policy
    assert policy.capacity == model.host.experts and policy.name == "expert-cache"
    counted = [c for call in policy.figures()["counted"] for c in call if c is not None]
    assert counted and all(c["misses"] == 0 and c["hits"] > 0 for c in counted)
    model.use("expert-cache", capacity=model.host.experts, rule="lru")  # cold: the same prompt copies experts
    assert simulate_check.moved_bytes([run_episode(model, prompt, continuation=4)]) > 0


def test_measure_writes_the_expert_cache_figure_beside_resident(tmp_path, monkeypatch):
    """The machine file of `measure` holds expert-cache's own zero-copy compute under the shape's
    entry (`families`), with its source naming the held-out prompt and the 0 B its ledger moved."""
    machine = measure(tmp_path, monkeypatch, H100)
    own = machine["decode_compute_ms"]["mixtral-tiny:3"]["families"]["expert-cache"]
    assert own["value"] > 0 and "0 B moved" in own["source"] and "generator seed 1" in own["source"]
    assert "capacity=8" in own["source"]
