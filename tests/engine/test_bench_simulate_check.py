"""bench.simulate_check measure on the CPU (the twin of its step in bench/simulate_check_device.sh):
the machine file it writes keeps the rates it measured, whatever file OVERHEAD_FROM names."""

import json
import sys
from pathlib import Path

import pytest

from bench import simulate_check
from packbench.engine.moe.synth import synth_moe

H100 = Path(__file__).resolve().parents[2] / "bench" / "machines" / "h100.json"


def measure(tmp_path, monkeypatch, *args: str):
    """`measure` on a tiny Mixtral on the CPU with `args` (--overhead, --rates-from, --repeats ...):
    the machine file it wrote."""
    model = synth_moe(tmp_path / "mixtral", shape="mixtral-tiny", seed=2, dtype="float32")
    monkeypatch.setattr(sys, "argv", ["simulate_check", "measure", "--model", str(model), "--device", "cpu",
                                      "--dtype", "float32", "--prefix", "4", "--continuation", "3", *args,
                                      "--machine-out", str(tmp_path / "machine.json"),
                                      "--trace-out", str(tmp_path / "routing.trace")])
    simulate_check.main()
    return json.loads((tmp_path / "machine.json").read_text())


def test_a_machine_file_as_overhead_gives_its_overhead_only(tmp_path, monkeypatch):
    """OVERHEAD_FROM=bench/machines/h100.json (the one overhead term in the checkout, which is all a
    device call carries) was spread whole over the measured machine: its name, its H100 copy rate
    and its Qwen3-only compute table replaced this call's, so Mixtral's predictions had no compute."""
    h100 = json.loads(H100.read_text())
    machine = measure(tmp_path, monkeypatch, "--repeats", "1", "--overhead", str(H100))
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
        measure(tmp_path, monkeypatch, "--repeats", "1", "--overhead", str(bad))
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
    machine = measure(tmp_path, monkeypatch, "--repeats", "1", "--overhead", str(H100))
    own = machine["decode_compute_ms"]["mixtral-tiny:3"]["families"]["expert-cache"]
    assert own["value"] > 0 and "0 B moved" in own["source"] and "generator seed 1" in own["source"]
    assert "capacity=8" in own["source"]


# ----------------------------------------------------------------------------- the rates screen


def rates_screen(conditions: dict[str, list[float]], *, mb: float = 0.0):
    """A read screen (core/report.py ScreenData's fields measured_of reads): per condition, two scored
    episodes whose steady decode calls take the given ms, every decode call moving `mb` MB."""
    from types import SimpleNamespace

    episodes = []
    for name, steady in conditions.items():
        for i, ms in enumerate(steady):
            calls = [{"phase": p, "wall_s": w / 1e3, "tokens": 1, "h2d_weight_bytes": [int(mb * 1e6)] if p == "decode"
                      else [0], "h2d_index_bytes": [0]} for p, w in (("prefill", 50.0), ("decode", 40.0),
                                                                        ("decode", ms), ("decode", ms))]
            record = {"condition": name, "role": "scored", "status": "ok", "plan_index": len(episodes), "calls": calls,
                      "wall_s": 1.0}
            episodes.append(SimpleNamespace(condition=name, scored=True, ok=True, calls=calls, record=record))
    protocol = SimpleNamespace(name="simulate-rates-x", dtype="float16", prefix_tokens=128, continuation_tokens=16,
                               conditions=[SimpleNamespace(name=n, tier="exact") for n in conditions])
    return SimpleNamespace(protocol=protocol, episodes=episodes)


def test_the_rates_screen_gives_resident_and_the_caches_compute_less_what_its_cache_moved(tmp_path, monkeypatch):
    """`measure --rates-from`: resident's figure is the screen's steady decode call as measured; the
    cache family's is cache-all's less the copy time of the MB its decode calls moved (a cold cache
    fetches the experts the prefill did not route), so the caches are not charged a copy twice."""
    import packbench.core.report as report

    archive = tmp_path / "rates.zip"
    archive.write_bytes(b"stands for the archive read_screen is given")
    monkeypatch.setattr(report, "read_screen",
                        lambda path: rates_screen({"resident": [30.0, 34.0, 32.0], "cache-all": [40.0, 44.0, 42.0]},
                                                  mb=5.0))
    resident, families = simulate_check.screen_rates(archive, copy_bps=50e9, cmd="cmd", where="here")
    assert resident["value"] == pytest.approx(32.0)  # the median episode, not a mean or a pooled median
    assert "episodes 30.00-34.00 ms" in resident["source"] and "simulate-rates-x" in resident["source"]
    assert list(families) == ["expert-cache"]
    assert families["expert-cache"]["value"] == pytest.approx(42.0 - 5e6 / 50e9 * 1e3)  # 0.1 ms of copies out
    assert "less its 5.0 MB per decode token at the copy rate (0.10 ms)" in families["expert-cache"]["source"]


@pytest.mark.parametrize("conditions, fragment", [
    ({"resident": [30.0]}, "no finished scored episode of cache-all in screen 'simulate-rates-x'"),
    ({"packet": [30.0]}, "no finished scored episode of resident, cache-all"),
])
def test_a_rates_screen_without_its_conditions_is_refused_in_one_line(tmp_path, monkeypatch, conditions, fragment):
    import packbench.core.report as report

    archive = tmp_path / "rates.zip"
    archive.write_bytes(b"x")
    monkeypatch.setattr(report, "read_screen", lambda path: rates_screen(conditions))
    with pytest.raises(SystemExit) as e:
        simulate_check.screen_rates(archive, copy_bps=50e9, cmd="cmd", where="here")
    assert isinstance(e.value.code, str) and "\n" not in e.value.code
    assert e.value.code.startswith(f"--rates-from {archive}: ") and fragment in e.value.code


def test_a_junk_rates_archive_is_refused_in_one_line_before_any_model_is_read(tmp_path, monkeypatch):
    junk = tmp_path / "rates.zip"
    junk.write_bytes(b"not a zip")
    model = tmp_path / "no-model-here"  # measure would fail on it, later, with a traceback of its own
    monkeypatch.setattr(sys, "argv", ["simulate_check", "measure", "--model", str(model), "--device", "cpu",
                                      "--dtype", "float32", "--rates-from", str(junk),
                                      "--machine-out", str(tmp_path / "machine.json"),
                                      "--trace-out", str(tmp_path / "routing.trace")])
    with pytest.raises(SystemExit) as e:
        simulate_check.main()
    assert isinstance(e.value.code, str) and "\n" not in e.value.code
    assert e.value.code.startswith(f"--rates-from {junk}: not a readable screen archive")
    assert not (tmp_path / "machine.json").exists()


def test_measure_with_a_rates_screen_writes_its_figures_and_times_nothing_itself(tmp_path, monkeypatch):
    """With --rates-from, the machine file's compute is the rates screen's (the worker's timing), not
    episodes run here: run_episode is called for the warm-up and the traced episode only."""
    import packbench.core.report as report
    import packbench.engine.episode as episode

    archive = tmp_path / "rates.zip"
    archive.write_bytes(b"x")
    monkeypatch.setattr(report, "read_screen",
                        lambda path: rates_screen({"resident": [7.0, 7.5, 8.0], "cache-all": [9.0, 9.5, 10.0]}))
    runs = []
    real = episode.run_episode
    monkeypatch.setattr(episode, "run_episode", lambda *a, **k: runs.append(k["continuation"]) or real(*a, **k))
    machine = measure(tmp_path, monkeypatch, "--repeats", "3", "--rates-from", str(archive))
    entry = machine["decode_compute_ms"]["mixtral-tiny:3"]
    assert entry["value"] == pytest.approx(7.5) and entry["families"]["expert-cache"]["value"] == pytest.approx(9.5)
    assert "timed by its worker" in entry["source"]
    assert runs == [3, 3]  # the warm-up (min(3, 4) tokens) and the traced episode; no timed repeats
    assert (tmp_path / "routing.trace").stat().st_size > 0


def test_copy_profile_reads_a_policy_spec_as_simulate_writes_it():
    """bench.copy_profile takes `packbench simulate`'s --policy form: integers as integers (a capacity
    of "4" would be refused by the cache), the rest as words, a bare name with no parameters."""
    from bench.copy_profile import parse_policy

    def spec_of(text):
        return parse_policy(text, "expert")

    assert spec_of("expert-cache:capacity=4,rule=lfu,forecast=on") == (
        "expert-cache", {"capacity": 4, "rule": "lfu", "forecast": "on"})
    assert spec_of("packet:gather=device") == ("packet", {"gather": "device"})
    assert spec_of("expert-forecast") == ("expert-forecast", {})


def test_predict_judges_the_steady_call_and_keeps_the_mean_beside_it(tmp_path, monkeypatch):
    """The screen measures the median steady decode call; predictions.json's judged `ms` must be
    simulate's `steady_call_ms`, not its mean per token (Mixtral LRU 4: 27.34 against 32.91, measured
    27.64: the mean missed by 16 %)."""
    decode = {"h2d_weight_bytes": 2_000_000, "h2d_index_bytes": 0, "tokens": 2, "hit_rate": 0.5, "belady_rate": 0.75}
    fake = {"model": {"shape": "s", "layers": 4}, "calls": 3, "episodes": 1, "assumptions": "a",
            "policies": [{"totals": {"decode": decode},
                          "prediction": {"decode_ms_per_token": 32.91, "steady_call_ms": 27.34, "compute_ms_per_token": 8.0,
                                         "copy_ms_per_token": 24.0, "overhead_ms_per_token": 0.9, "overhead": "o"}}]}
    monkeypatch.setattr(simulate_check, "simulate", lambda trace, machine, specs: fake)
    (tmp_path / "machine.json").write_text(json.dumps({"name": "m", "pinned_h2d_gbps": {"value": 55, "source": "s"}}))
    (tmp_path / "r.trace").write_bytes(b"t")
    monkeypatch.setattr(sys, "argv", ["simulate_check", "predict", "--trace", str(tmp_path / "r.trace"), "--machine",
                                      str(tmp_path / "machine.json"), "--out", str(tmp_path / "predictions.md"),
                                      "--condition", "lru-4=expert-cache:capacity=4,rule=lru"])
    simulate_check.main()
    row = json.loads((tmp_path / "predictions.json").read_text())["rows"][0]
    assert row["ms"] == 27.34 and row["mean_ms"] == 32.91 and row["mb"] == pytest.approx(1.0)
    assert "| lru-4 | `expert-cache:capacity=4,rule=lru` | 27.34 | 32.91 | 8.00 | 24.00 |" in (
        tmp_path / "predictions.md").read_text()
    judged = simulate_check.judged([row], {"lru-4": {"ms": 27.64}})[0]
    assert judged["within"] is True and judged["ratio"] == pytest.approx(27.64 / 27.34)
