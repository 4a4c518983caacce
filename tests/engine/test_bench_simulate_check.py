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
