"""Schema 6: the `accelerate` competitor and every competitor's frozen `mode`. A protocol with a
competitor freezes as schema 6 with its mode written out; every earlier body keeps its meaning
and hash (a schema-5 competitor has no mode and runs eager)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from packbench.core.errors import ProtocolError
from packbench.core.protocol import expand, freeze, validate
from packbench.core.registry import QUANT_METHODS, fastest_mode
from tests.core.test_protocol_schema4 import TINY, protocol
from tests.core.test_protocol_schema5 import competitor

ROOT = Path(__file__).resolve().parents[2]


def quantized(method: str, **params) -> dict:
    return {"name": "low", "policy": "quantized", "params": {"method": method, **params}}


def test_schema_5_bodies_freeze_and_mean_what_they_did():
    five = freeze(competitor())  # competitor() pins schema 5
    assert five.body["schema"] == 5 and "mode" not in five.body["conditions"][1]["params"]
    assert expand(five.body).condition("int8").resolved_params == {"method": "int8-weight-only", "mode": "eager"}
    assert validate(five.body) == five.body
    # without competitors, schema 6 freezes exactly as 5, 4 and 3 did
    for raw in (protocol(TINY), protocol({**TINY, "sparsity": 0.9})):
        assert freeze({**raw, "schema": 6}).body == freeze({**raw, "schema": 5}).body == freeze({**raw, "schema": 7}).body


@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_schema_6_writes_each_competitors_fastest_mode(method):
    raw = competitor(schema=6, conditions=[{"policy": "dense-stream"}, quantized(method)])
    frozen = freeze(raw)
    assert frozen.body["schema"] == 6
    assert frozen.body["conditions"][1]["params"] == {"method": method, "mode": fastest_mode("quantized", {"method": method})}
    assert validate(frozen.body) == frozen.body
    written = competitor(schema=6, conditions=[{"policy": "dense-stream"},
                                               quantized(method, mode=fastest_mode("quantized", {"method": method}))])
    assert freeze(written).sha256 == frozen.sha256  # one meaning, one hash


def test_accelerate_is_an_exact_schema_6_condition():
    raw = protocol(TINY, conditions=[{"policy": "dense-stream"}, {"policy": "accelerate"}])
    frozen = freeze(raw)
    assert frozen.body["schema"] == 6 and frozen.body["conditions"][1] == {
        "name": "accelerate", "policy": "accelerate", "params": {"mode": "eager"}}
    assert expand(frozen.body).tier("accelerate") == "exact"


def test_torchao_runs_in_every_mode_and_exact_conditions_keep_the_protocols():
    for mode in ("eager", "graph", "compile"):
        raw = competitor(schema=6, engine={"mode": "graph"},
                         conditions=[{"policy": "dense-stream"}, quantized("int8-weight-only", mode=mode)])
        assert freeze(raw).body["conditions"][1]["params"]["mode"] == mode


def test_nf4_and_int4_default_to_compile_and_llm_int8_stays_eager():
    """nf4 launches its kernels on shapes alone: graph and compile freeze (a CUDA worker refuses
    graph, which failed on the H200); an omitted mode is its measured fastest, compile (3.04
    against eager's 21.81 ms/token at OPT-2.7B on the H200), as for int4 weight-only (2.59 against
    49.01), while llm-int8, which cannot be captured, is written out eager."""
    for mode in ("graph", "compile"):
        raw = competitor(schema=6, conditions=[{"policy": "dense-stream"}, quantized("nf4", mode=mode)])
        assert freeze(raw).body["conditions"][1]["params"]["mode"] == mode
    written = {method: freeze(competitor(schema=6, conditions=[{"policy": "dense-stream"}, quantized(method)]))
               .body["conditions"][1]["params"]["mode"] for method in QUANT_METHODS}
    assert written == {"int8-weight-only": "compile", "int4-weight-only": "compile", "nf4": "compile",
                       "llm-int8": "eager"}
    from packbench.core.registry import mode_refusal

    assert mode_refusal("quantized", {"method": "nf4"}, "graph") is None
    from packbench.core.registry import stack_refusal

    assert stack_refusal("quantized", {"method": "nf4", "mode": "graph"}).startswith("capturing")
    assert stack_refusal("quantized", {"method": "nf4", "mode": "compile"}) is None
    assert mode_refusal("quantized", {"method": "llm-int8"}, "compile").startswith("cannot be captured")


@pytest.mark.parametrize("changes, fragment", [
    ({"conditions": [{"policy": "dense-stream"}, quantized("llm-int8", mode="graph")]},
     "`conditions[1].params.mode`: graph is not possible for llm-int8 (cannot be captured: bitsandbytes' llm-int8"),
    ({"conditions": [{"policy": "dense-stream"}, quantized("llm-int8", mode="compile")]},
     "`conditions[1].params.mode`: compile is not possible for llm-int8 (cannot be captured"),
    ({"conditions": [{"policy": "dense-stream"}, {"policy": "accelerate", "params": {"mode": "graph"}}],
      "gates": {"faithfulness": None}},
     "`conditions[1].params.mode`: graph is not possible for accelerate (cannot be captured: accelerate's hooks"),
    ({"conditions": [{"policy": "dense-stream"}, quantized("int8-weight-only", mode="jit")]},
     "`conditions[1].params.mode`: 'jit' is not allowed; use one of eager, graph, compile"),
    ({"schema": 5, "conditions": [{"policy": "dense-stream"}, quantized("int8-weight-only", mode="eager")]},
     "`conditions[1].params.mode`: needs schema 6; write schema: 6 or omit `schema:`"),
    ({"schema": 5, "conditions": [{"policy": "dense-stream"}, {"policy": "accelerate"}],
      "gates": {"faithfulness": None}},
     "`conditions[1].policy`: 'accelerate' needs schema 6; write schema: 6 or omit `schema:`"),
    ({"conditions": [{"policy": "dense-stream"}, {"policy": "accelerate", "params": {"method": "nf4"}}],
      "gates": {"faithfulness": None}},
     "`conditions[1].params.method`: unknown param; policy accelerate takes mode"),
])
def test_refusals_name_the_field_and_the_fix(changes, fragment):
    with pytest.raises(ProtocolError) as e:
        validate(competitor(**{"schema": 6, **changes}))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_validate_refuses_a_mode_the_library_cannot_run_in_one_line_exit_2(tmp_path):
    raw = competitor(conditions=[{"policy": "dense-stream"}, quantized("llm-int8", mode="graph")])
    raw.pop("schema")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate", str(tmp_path / "p.yaml")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "`conditions[1].params.mode`: graph is not possible for llm-int8 (cannot be captured" in lines[0]
    assert "use mode eager" in lines[0]


def test_the_plan_estimates_accelerates_bytes_as_the_parameters_beyond_the_allowance():
    from packbench.core.estimate import Activity, ModelShape, call_h2d_bytes
    from packbench.core.registry import SHAPES

    shape = ModelShape(**{k: SHAPES["opt-2.7b"][k] for k in ("hidden", "ffn", "layers", "vocab")})
    kw = dict(shape=shape, row_bytes=shape.hidden * 2, activity=Activity(sparsity=0.95), tokens=1, phase="decode")
    params = shape.param_count() * 2
    assert call_h2d_bytes("accelerate", {}, allowance_bytes=4800 << 20, **kw) == params - (4800 << 20)
    assert call_h2d_bytes("accelerate", {}, allowance_bytes=params, **kw) == 0


def test_torchao_in_mode_graph_freezes_and_the_plan_says_a_cuda_worker_refuses_it(tmp_path, packbench_cli):
    """The mode is valid (old meanings never move; the CPU runs it eagerly); the measured CUDA stack
    fails its capture (core.registry.STACK_REFUSALS), which `protocol plan` states beside the condition."""
    from packbench.core.registry import stack_refusal

    assert stack_refusal("quantized", {"method": "int8-weight-only", "mode": "graph"}).startswith("capturing")
    assert stack_refusal("quantized", {"method": "int8-weight-only", "mode": "compile"}) is None
    raw = competitor(conditions=[{"policy": "dense-stream"}, quantized("int8-weight-only", mode="graph")])
    raw.pop("schema")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    out = packbench_cli("protocol", "plan", str(tmp_path / "p.yaml"))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "low (torchao): mode graph" in x)
    assert "a CUDA worker refuses mode graph here" in line and "mode compile" in line


def test_the_shipped_competitors_protocol_writes_each_competitors_mode_and_tier():
    from packbench.core.protocol import load

    frozen = load(ROOT / "protocols" / "competitors.yaml")
    p = frozen.protocol
    assert frozen.body["schema"] == 6
    assert {n: p.tier(n) for n in p.condition_names} == {
        "dense-stream": "exact", "packet": "exact", "dense-stream-int8": "exact", "packet-int8": "exact",
        "accelerate": "exact", "int8": "approximate", "nf4": "approximate", "llm-int8": "approximate"}
    modes = {c["name"]: c["params"]["mode"] for c in frozen.body["conditions"] if "mode" in c.get("params", {})}
    assert modes == {"accelerate": "eager", "int8": "compile", "nf4": "compile", "llm-int8": "eager"}
    assert sorted(b.condition for b in p.gates.fidelity) == ["int8", "llm-int8", "nf4"]
