"""`packbench protocol validate|show|plan`, `--version`, completion and Enum choices; the
estimate behind `plan` (core/estimate.py) checked against real shapes and a real archive."""

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from packbench.cli.main import app
from packbench.core import report as data
from packbench.core.estimate import Activity, ModelShape, call_h2d_bytes, estimate
from packbench.core.plan import plan
from packbench.core.protocol import load
from packbench.core.registry import DTYPE_NAMES, POLICY_NAMES, SYNTH_SHAPES

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
GATES = DATA / "gates-v2.yaml"


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The real command line: exit codes and one-line errors come from cli.main.main()."""
    return subprocess.run([sys.executable, "-m", "packbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_validate_prints_the_frozen_identity():
    r = invoke("protocol", "validate", str(GATES))
    assert r.exit_code == 0, r.output
    frozen = load(GATES)
    assert r.output.splitlines() == [
        f"valid: gates-v2 (schema 2), sha256 {frozen.sha256}, 4 conditions, {len(plan(frozen.body))} planned episodes",
        "  dense-stream: dense-stream",
        "  packet: packet, gather host",  # a schema-2 packet that omits gather: what runs is spelled out
        "  phase-switched: phase-switched, gather host",
        "  extents: sparse-extents, block_rows 32"]


def test_show_prints_the_frozen_body():
    r = invoke("protocol", "show", str(GATES))
    assert r.exit_code == 0, r.output
    head, *runs, body = r.output.split("\n", 5)
    frozen = load(GATES)
    assert head == f"# gates-v2: sha256 {frozen.sha256} (schema 2)"
    assert runs[1] == "#   packet: packet, gather host"
    assert json.loads(body) == frozen.body
    full = invoke("protocol", "show", str(DATA / "quickstart-v1.yaml"), "--full")
    assert json.loads(full.output.split("\n", 3)[3])["schema"] == 2  # every default spelled out


def test_a_new_protocol_shows_the_device_gather_it_runs(tmp_path):
    """Schema 3 (a YAML without `schema:`): packet gathers on the device, and every command says so."""
    path = tmp_path / "new.yaml"
    (tmp_path / "gates-v2-prompts.json").write_bytes((DATA / "gates-v2-prompts.json").read_bytes())
    path.write_text(GATES.read_text().replace("schema: 2\n", ""))
    frozen = load(path)
    assert frozen.body["conditions"][1]["params"] == {"gather": "device"}
    r = invoke("protocol", "validate", str(path))
    assert r.exit_code == 0, r.output
    assert "(read as schema 11, frozen as schema 2)" in r.output and "  packet: packet, gather device\n" in r.output
    r = invoke("protocol", "show", str(path))
    assert "#   packet: packet, gather device\n" in r.output
    assert json.loads(r.output.split("\n", 5)[5])["conditions"][1]["params"] == {"gather": "device"}
    r = invoke("protocol", "plan", str(path))
    assert r.exit_code == 0 and "packet, gather device" in r.output, r.output
    path.write_text(GATES.read_text().replace("schema: 2", "schema: 12"))
    r = run("protocol", "validate", str(path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "12 is not supported; this packbench reads schema 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 11" in r.stderr


def test_plan_lists_the_episodes_in_order_and_what_each_condition_moves():
    r = invoke("protocol", "plan", str(GATES), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    frozen = load(GATES)
    assert out["entries"] == plan(frozen.body)
    rows = {c["condition"]: c for c in out["estimate"]["conditions"]}
    # tiny float32: 2 layers x 256 rows x 64 x 4 B; dense-stream moves every row of every call
    assert rows["dense-stream"]["prefill_call_bytes"] == rows["dense-stream"]["decode_call_bytes"] == 2 * 256 * 256
    assert rows["dense-stream"]["episodes"] == sum(e["condition"] == "dense-stream" for e in out["entries"])
    assert rows["phase-switched"]["prefill_call_bytes"] == 2 * 256 * 256  # dense prefill
    assert rows["phase-switched"]["decode_call_bytes"] == rows["packet"]["decode_call_bytes"]
    table = invoke("protocol", "plan", str(GATES), "--device", "NVIDIA H200")  # a GPU: the transfer floor
    assert table.exit_code == 0
    assert "index  condition" in table.output and "transfer floor at 55 GB/s" in table.output
    assert "parameters 597.5 kB (fit the 1 MiB allowance)" in table.output


def test_plan_says_what_a_cpu_screen_is_and_prints_plain_numbers(tmp_path):
    from packbench.cli import protocol_cmd

    no_db = ("--db", f"sqlite:///{tmp_path / 'none.db'}")
    out = invoke("protocol", "plan", str(GATES), "--device", "cpu", *no_db).output
    assert "no GPU on this machine: a screen dispatched here runs on the CPU" in out
    # a CPU screen gets no GPU bound (one put at >= 1.896 s took 293-301 s): no rate is known
    assert "GPU transfer/episode" not in out and "of transfer on a GPU" not in out
    assert "time: no rate is known for a CPU screen" in out
    assert not [n for n in out.split() if "e-0" in n or "e+0" in n], out  # no 1.907e-05
    assert protocol_cmd._seconds(1.907e-05) == "19.07 µs" and protocol_cmd._seconds(1.896) == "1.896 s"
    out = invoke("protocol", "plan", str(GATES), "--device", "NVIDIA H200", *no_db).output
    assert "no GPU on this machine" not in out and "GPU transfer/episode" in out
    assert "a GPU-rate bound (the transfer floor at 55 GB/s)" in out


def test_plan_estimate_is_close_to_what_a_real_screen_moved():
    """Against gates-v2.zip (a real CPU screen of that protocol): decode packets within 10 %;
    the prefill union is an upper estimate (independent tokens), never below what was moved."""
    s = data.read_screen(DATA / "gates-v2.zip")
    synth = s.protocol.model.synth
    est = estimate(s.protocol, shape=ModelShape.of(synth.shape),
                   activity=Activity(synth.sparsity, synth.hot_fraction, synth.hot_bias))
    rows = {c["condition"]: c for c in est["conditions"]}
    measured = data.h2d_per_call(s)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for condition in ("packet", "extents", "phase-switched"):
        got = mean(measured[condition]["decode"])
        assert abs(rows[condition]["decode_call_bytes"] - got) / got < 0.10, (condition, got)
    assert rows["packet"]["prefill_call_bytes"] >= mean(measured["packet"]["prefill"])
    assert rows["dense-stream"]["decode_call_bytes"] == mean(measured["dense-stream"]["decode"])


def test_estimate_matches_the_measured_opt_2_7b_figures():
    """Shapes and bytes as the seed's v0.40 screen and the H200 notes measured them."""
    shape = ModelShape.of("opt-2.7b")
    assert shape.param_count() * 2 == 5_303_193_600  # "Full FP16 parameter bytes 5,303,193,600"
    dense = call_h2d_bytes("dense-stream", {}, phase="decode", tokens=1, shape=shape, row_bytes=2560 * 2,
                           activity=Activity(0.94))
    assert dense == 1_677_721_600  # fc2 per forward call, fp16 (shared/device/NOTES.md)
    assert call_h2d_bytes("resident", {}, phase="decode", tokens=1, shape=shape, row_bytes=5120,
                          activity=Activity(0.94)) == 0
    assert Activity(0.94).union_fraction(1) == pytest.approx(0.06)
    assert Activity(0.94, hot_fraction=1.0, hot_bias=0.0).union_fraction(1) == pytest.approx(0.5)


def test_plan_needs_sparsity_and_shape_for_a_checkpoint_path(tmp_path, tiny):
    real = tmp_path / "real"  # a checkpoint that does not say its sparsity (not written by model synth)
    real.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    config.pop("packbench_synth")
    (real / "config.json").write_text(json.dumps(config))
    quickstart = (ROOT / "protocols" / "quickstart.yaml").read_text()
    (tmp_path / "real.yaml").write_text(quickstart.replace("../.packbench/models/tiny", str(real)))
    r = run("protocol", "plan", str(tmp_path / "real.yaml"))
    assert r.returncode == 2 and "--sparsity" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "synth.yaml").write_text(quickstart.replace("../.packbench/models/tiny", str(tiny)))
    r = run("protocol", "plan", str(tmp_path / "synth.yaml"))  # model synth wrote its sparsity: 0.94
    assert r.returncode == 0 and "active per call 6.00% (decode)" in r.stdout, r.stderr
    uniform = r.stdout
    from packbench.engine.synth import synth_checkpoint  # a profile's checkpoint: its config.json names the profile

    profiled = synth_checkpoint(tmp_path / "profiled", shape="tiny", dtype="float32", seed=0, profile="opt")
    (tmp_path / "profiled.yaml").write_text(quickstart.replace("../.packbench/models/tiny", str(profiled)))
    r = run("protocol", "plan", str(tmp_path / "profiled.yaml"))
    assert r.returncode == 0 and "active per call 6.00% (decode)" in r.stdout, r.stderr
    prefill = lambda out: out.split("up to ")[1].split("%")[0]  # noqa: E731
    assert float(prefill(r.stdout)) < float(prefill(uniform))  # heavy-tailed rates: a smaller union
    (tmp_path / "p.yaml").write_text((ROOT / "protocols" / "quickstart.yaml").read_text().replace(
        "../.packbench/models/tiny", str(tmp_path / "absent")))
    r = run("protocol", "plan", str(tmp_path / "p.yaml"), "--sparsity", "0.94")
    assert r.returncode == 2 and "give --shape" in r.stderr, r.stderr
    r = run("protocol", "plan", str(tmp_path / "p.yaml"), "--sparsity", "0.94", "--shape", "tiny")
    assert r.returncode == 0, r.stderr
    r = run("protocol", "plan", str(tmp_path / "p.yaml"), "--sparsity", "0.94", "--shape", "opt-9b")
    assert r.returncode == 2 and "opt-2.7b" in r.stderr  # the choices are listed


def test_bad_protocol_files_are_one_line(tmp_path):
    r = run("protocol", "validate", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "no protocol file" in r.stderr
    (tmp_path / "bad.yaml").write_text(GATES.read_text().replace("policy: packet", "policy: pakcet"))
    r = run("protocol", "validate", str(tmp_path / "bad.yaml"))
    assert r.returncode == 2 and "'pakcet' is not allowed" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_version_and_completion():
    r = invoke("--version")
    assert r.exit_code == 0 and r.output.strip() == f"packbench {metadata.version('packbench')}"
    helptext = invoke("--help").output
    assert "--install-completion" in helptext and "--show-completion" in helptext
    for command in ("report", "protocol"):
        assert command in helptext


def complete(line: str) -> list[str]:
    """What shell completion offers after `line` (typer's zsh protocol, in process)."""
    r = CliRunner().invoke(app, [], prog_name="packbench",
                           env={"_PACKBENCH_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": line})
    return re.findall(r'"([^"]+)"', r.output)


def test_options_with_a_closed_set_of_values_complete():
    from packbench.core.protocol import GATE_NAMES

    assert complete("packbench results --gate ") == list(GATE_NAMES)
    assert complete("packbench compare --format ") == ["table", "json", "csv"]
    assert complete("packbench results --condition ") == list(POLICY_NAMES)


def test_validate_and_db_upgrade_take_json(tmp_path):
    r = invoke("protocol", "validate", str(GATES), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["valid"] is True and out["sha256"] == load(GATES).sha256
    assert out["planned_episodes"] == len(plan(load(GATES).body))
    r = invoke("db", "upgrade", "--db", f"sqlite:///{tmp_path / 'pb.db'}", "--json")
    assert r.exit_code == 0, r.output
    up = json.loads(r.output)
    assert up["from"] is None and up["revision"] == up["head"]


def test_enum_choices_come_from_the_registry():
    from packbench.cli.choices import Dtype, Policy, Shape

    assert tuple(s.value for s in Shape) == SYNTH_SHAPES
    assert tuple(d.value for d in Dtype) == DTYPE_NAMES
    assert tuple(p.value for p in Policy) == POLICY_NAMES
    helptext = CliRunner().invoke(app, ["protocol", "plan", "--help"], env={"COLUMNS": "200"}).output
    assert "<" + "|".join(SYNTH_SHAPES) + ">" in helptext


def test_plan_refuses_what_validate_and_submit_refuse_of_an_offloading_peer(tmp_path):
    """`protocol plan` on an OPT model never ran check_family: a zero-inference condition under an
    allowance below DeepSpeed's minimum (synthetic OPT-125m, 64 MiB: its embedding alone is 147 MiB)
    was planned, exit 0, where validate and submit refuse it in one line naming the MiB it needs."""
    f = tmp_path / "zi.yaml"
    f.write_text("name: zi\nmodel: {synth: {shape: opt-125m, dtype: float32, seed: 0}}\ndtype: float32\n"
                 "prompts: {generator: {seed: 0, count: 1}}\nprefix_tokens: 8\ncontinuation_tokens: 2\n"
                 "conditions: [{policy: dense-stream}, {policy: zero-inference}]\nreference: dense-stream\n"
                 "warmups: 1\nallowance_mib: 64\ngates: {faithfulness: {}}\n")
    for command in ("validate", "plan"):
        r = run("protocol", command, str(f))
        assert r.returncode == 2 and r.stdout == "", (command, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and "zero-inference needs an allowance of at least 149 MiB" in r.stderr


def test_an_approximate_condition_no_gate_judges_is_named_in_a_warning_and_still_valid(tmp_path):
    """An approximate competitor without a fidelity gate ran, and the verdicts said nothing of it:
    `protocol validate` and `submit` name it (one line, exit 0); judged, no line (catches the
    warning missing, naming a judged or an exact condition, or refusing the protocol)."""
    import yaml

    body = {"name": "unjudged", "model": {"synth": {"shape": "tiny", "seed": 0, "dtype": "float32"}},
            "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8,
            "continuation_tokens": 3, "reference": "dense-stream", "allowance_mib": 64,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"},
                           {"name": "q8", "policy": "quantized", "params": {"method": "int8-weight-only"}},
                           {"name": "q4", "policy": "quantized", "params": {"method": "int4-weight-only"}}],
            "gates": {"faithfulness": {}, "fidelity": [{"condition": "q4", "min_top1": 0.5}]}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(body))
    r = invoke("protocol", "validate", str(path))
    assert r.exit_code == 0 and r.stdout.startswith("valid: "), (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "warning: q8 is approximate and no fidelity gate judges it: the fidelity figures are recorded, but no "
        "verdict says whether they are good enough; add gates.fidelity (docs/protocol.md) to judge it"]
    doc = json.loads(invoke("protocol", "validate", str(path), "--json").stdout)
    assert doc["unjudged"] == r.stderr.strip()[len("warning: "):] and doc["warning"] is None
    db = f"sqlite:///{tmp_path / 's.db'}"
    assert invoke("db", "upgrade", "--db", db).exit_code == 0
    r = invoke("submit", str(path), "--db", db, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"queued": [1]}, (r.stdout, r.stderr)
    assert r.stderr.strip() == f"warning: {doc['unjudged']}"
    body["gates"]["fidelity"].append({"condition": "q8", "min_top1": 0.5})
    path.write_text(yaml.safe_dump(body))
    r = invoke("protocol", "validate", str(path))
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    body["gates"].pop("fidelity")  # both unjudged: one line names both
    path.write_text(yaml.safe_dump(body))
    assert invoke("protocol", "validate", str(path)).stderr.startswith(
        "warning: q8, q4 are approximate and no fidelity gate judges them")


def test_the_moe_plan_gives_a_tiny_experts_size_in_figures_that_are_not_zero(tmp_path):
    """A tiny shape's 16 experts of 24 KiB each were printed `of 0.0 MiB` (catches a fixed
    decimal that rounds a small expert to nothing)."""
    import yaml

    from packbench.core.moe import MoeShape

    body = {"name": "moe-plan", "model": {"synth": {"shape": "qwen3-moe-tiny", "seed": 0, "dtype": "float32"}},
            "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 8,
            "continuation_tokens": 3, "reference": "dense-stream", "allowance_mib": 64,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}], "gates": {"faithfulness": {}}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(body))
    r = invoke("protocol", "plan", str(path), "--device", "cpu", "--db", f"sqlite:///{tmp_path / 'n.db'}")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    mib = MoeShape.of("qwen3-moe-tiny").expert_bytes("float32") / 2**20
    assert f"3 layers x 16 experts (top 4) of {mib:.3g} MiB;" in r.stdout and mib > 0.01


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("gbps", ["5e-324", "1e-300", "9.99e-10", "0", "-1", "1.01e12", "1e308"])
def test_plan_refuses_an_h2d_rate_its_transfer_time_cannot_hold(packbench_cli, gbps):
    """`protocol plan --h2d-gbps 5e-324 --json` printed `"total_transfer_s": Infinity` (no JSON;
    its table `inf s`): the rate is bounded as a machine file's pinned_h2d_gbps is, for the OPT plan,
    its --sweep and the MoE plan alike."""
    for args in ([], ["--sweep", "prefix_tokens=16,32"]):
        r = packbench_cli("protocol", "plan", str(GATES), "--h2d-gbps", gbps, "--json", *args)
        assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
        assert r.stderr.strip().splitlines() == [
            f"error: Invalid value for '--h2d-gbps': {float(gbps):g} is not a rate in GB/s from 1e-09 to 1e+12; "
            f"see `packbench protocol plan --help`"], r.stderr


@pytest.mark.parametrize("gbps", ["1e-9", "1e12"])
def test_plan_at_the_h2d_rate_bounds_prints_strict_json(packbench_cli, tmp_path, gbps):
    r = packbench_cli("protocol", "plan", str(GATES), "--h2d-gbps", gbps, "--json", "--device", "NVIDIA H200",
                      "--db", f"sqlite:///{tmp_path / 'n.db'}")
    assert r.returncode == 0, r.stderr
    out = strict_json(r.stdout)
    assert out["estimate"]["h2d_gbps"] == float(gbps)
    assert all(0 < c["total_transfer_s"] < float("inf") for c in out["estimate"]["conditions"])


@pytest.mark.parametrize("allowance, left", [(20480, "538.9 MB"), (16384, "-3.756 GB")])
def test_plan_prints_the_loaders_device_room_even_when_it_is_negative(tmp_path, allowance, left):
    """The plan's `device:` line: OPT-13B fp16 loaders hold 17.32 GB (every weight but the 8.389 GB
    of outgoing rows), and 64 x (64 + 5) tokens' KV cache 3.618 GB; under 20480 MiB that leaves
    538.9 MB, under 16384 MiB it is 3.756 GB short, printed with its sign. Bug caught: the plan's
    byte formatter given a negative count prints it as raw bytes ("-3,756,... B")."""
    body = {"name": "room", "model": {"synth": {"shape": "opt-13b", "dtype": "float16", "seed": 0}},
            "dtype": "float16", "prompts": {"generator": {"seed": 0, "count": 64}}, "prefix_tokens": 64,
            "continuation_tokens": 5, "batch": 64, "scored_prompts": 1, "warmups": 1, "reference": "dense-stream",
            "allowance_mib": allowance, "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}],
            "gates": {"faithfulness": {}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(body))
    r = invoke("protocol", "plan", str(path), "--device", "cpu", "--db", f"sqlite:///{tmp_path / 'n.db'}")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert (f"device: packbench's loaders hold 17.32 GB + a KV cache of 3.618 GB at batch 64; {left} of the "
            f"allowance left for the CUDA context and activations (about 1.25 GB at this prefill)") in r.stdout
    assert "expect them to run out of memory" in r.stderr
