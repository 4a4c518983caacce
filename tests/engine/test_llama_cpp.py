"""The `llama-cpp` competitor on the CPU (llama-cpp-python's CPU build, the [llamacpp] extra, which
`make test` installs): each MoE family's GGUF conversion judged against dense-stream by the fidelity
gate's figures (and a conversion without Mixtral's rotary permutation failing it, so the check can
fail), the placement arithmetic against hand counts, the expert overrides' patterns, a screen of it
beside packets and host-experts archived and audited AGREE, an edited placement DISAGREEing, and its
refusals in one line. Marked `llamacpp`: a bare pytest deselects them (the extra builds llama.cpp)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cpu_screen import archive_screen
from packbench.core.audit import audit_archive
from packbench.core.conditions.base import RecordContext
from packbench.core.conditions.llama_cpp import (LlamaPlacement, PlacementRefused, choose_placement, kv_cells,
                                                 layer_bytes, record_problems, working_bytes)
from packbench.core.errors import ProtocolError
from packbench.core.fidelity import fidelity
from packbench.core.moe import MOE_SHAPES, call_bytes, moe_config, shape_of_config
from packbench.core.protocol import freeze
from packbench.engine.episode import run_episode
from packbench.engine.moe.model import CpuFirstMoE
from packbench.engine.moe.synth import synth_moe
from packbench.service.submit import check_family

pytestmark = pytest.mark.llamacpp
ROOT = Path(__file__).resolve().parents[2]
SHAPES = ("mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny")
PROMPTS = [list(range(7, 31)), list(range(40, 64))]  # a batch of two, 24 tokens each
CONTINUATION = 5
MIB = 1 << 20


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("llama-cpp")
    return {s: synth_moe(root / s, shape=s, seed=3, dtype="float32") for s in SHAPES}


def _llama(path: Path, cache: Path, *, batch: int = 2, capacity: int = 32, **params):
    from packbench.engine.llama_cpp import LlamaCppModel

    return LlamaCppModel(path, dtype=torch.float32, device=torch.device("cpu"), params=params,
                         allowance_bytes=1 << 30, context_bytes=0, capacity=capacity, batch=batch, cache=cache, threads=1)


def _against_reference(path: Path, model) -> list:
    ref_model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    ref_model.use("dense-stream")
    ref = run_episode(ref_model, PROMPTS, continuation=CONTINUATION)
    out = run_episode(model, PROMPTS, continuation=CONTINUATION, forced=ref.tokens)
    return [fidelity(np.asarray(ref.logits[s]), out.logits[s], reference_tokens=ref.tokens[s], tokens=out.tokens[s])
            for s in range(len(PROMPTS))], out


@pytest.mark.parametrize("shape", SHAPES)
def test_each_family_converts_and_runs_within_fidelity_of_dense_stream(moe, shape, tmp_path):
    """llama.cpp on packbench's GGUF of each family, teacher-forced on dense-stream's tokens, a batch
    of two: every position's top-1 the reference's and mean KL below 1e-3 (measured about 1e-5: its
    float16 KV cache and its own kernels). Catches a tensor mapped to the wrong GGUF name, an expert
    projection swapped, a wrong rotary layout or a metadata value (rms epsilon, rotary base) not the
    checkpoint's: each moves every logit. Its calls: one prefill of both prompts, one token a
    sequence a decode call; on the CPU no byte crosses a link."""
    model = _llama(moe[shape], tmp_path)
    figures, out = _against_reference(moe[shape], model)
    for f in figures:
        assert f.top1 == 1.0 and f.mean_kl < 1e-3 and f.max_abs_logit < 0.2, (shape, f)
    assert [c.tokens for c in out.calls] == [48] + [2] * (CONTINUATION - 1)
    assert out.logits.shape == (2, CONTINUATION, MOE_SHAPES[shape]["vocab"])
    assert all(sum(c.h2d_weight_bytes) == sum(c.h2d_index_bytes) == sum(c.d2h_bytes) == 0 for c in out.calls)
    model.release()
    model.release()  # twice: safe


def test_a_mixtral_gguf_without_the_rotary_permutation_fails_fidelity(moe, tmp_path, monkeypatch):
    """The check above can fail: Mixtral written as llama without permuting q and k to llama.cpp's
    interleaved rotary pairs (what convert_hf_to_gguf.py does) runs, and misses the reference."""
    from packbench.engine import llama_cpp

    monkeypatch.setattr(llama_cpp, "permute", lambda w, heads: w)
    figures, _ = _against_reference(moe["mixtral-tiny"], _llama(moe["mixtral-tiny"], tmp_path))
    assert max(f.mean_kl for f in figures) > 1e-3


def test_the_host_layers_change_where_experts_live_not_the_logits(moe, tmp_path):
    """n_cpu_moe 3 (every layer's experts overridden to the host buffer type) loads and gives the
    logits of n_cpu_moe 0 on the CPU, where both are host memory; the override patterns are
    llama.cpp's own (common/arg.cpp), one a layer, NULL-terminated."""
    from packbench.engine.llama_cpp import expert_overrides

    path = moe["qwen3-moe-tiny"]
    every = run_episode(_llama(path, tmp_path, n_cpu_moe=3), PROMPTS, continuation=3)
    none = run_episode(_llama(path, tmp_path, n_cpu_moe=0), PROMPTS, continuation=3)
    assert np.array_equal(every.logits, none.logits)
    rows = expert_overrides(2, 1234)
    assert [r.pattern for r in rows] == [rb"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                                         rb"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps", None]
    assert [r.buft for r in rows] == [1234, 1234, None]
    assert re.fullmatch(rows[1].pattern.decode() + r"\.weight", "blk.1.ffn_gate_exps.weight")


def test_a_links_ledger_follows_llama_cpps_rules_and_the_audits_row_rule(moe, tmp_path):
    """On a link (a CUDA worker's; forced here on the CPU): a prefill of 32 tokens or more copies each
    host layer's experts, as rows of one expert (so the auditor's rows x row bytes rule holds: an
    H100 screen's audit caught bytes charged with no rows); a decode call copies none; each host
    layer sends hidden states, ids and weights down and the output up, in float32; other layers nothing."""
    from packbench.core.metrics import row_bytes_problems

    s = MOE_SHAPES["qwen3-moe-tiny"]
    model = _llama(moe["qwen3-moe-tiny"], tmp_path, batch=1, capacity=48, n_cpu_moe=2, op_offload="on")
    model.link = True
    out = run_episode(model, [list(range(7, 47))], continuation=3)  # 40 tokens, then 1 a call
    expert = 3 * s["intermediate"] * s["hidden"] * 4
    prefill, decode = out.calls[0], out.calls[1]
    assert prefill.rows_copied == [s["experts"]] * 2 + [0] and prefill.h2d_weight_bytes == [s["experts"] * expert] * 2 + [0]
    assert decode.rows_copied == [0] * 3 and decode.h2d_weight_bytes == [0] * 3
    for call in (prefill, decode):
        t = call.tokens
        assert call.h2d_index_bytes == [t * 64 * 4] * 2 + [0]
        assert call.d2h_bytes == [t * (64 + 2 * s["k"]) * 4] * 2 + [0]
    assert row_bytes_problems([c.to_dict() for c in out.calls], expert) == ([], expert)
    model.op_offload = False
    assert run_episode(model, [list(range(7, 47))], continuation=2).calls[0].rows_copied == [0] * 3


def test_the_gguf_is_written_once_per_checkpoint_and_dtype(moe, tmp_path):
    from packbench.engine.llama_cpp import converted

    path = moe["olmoe-tiny"]
    a = converted(path, tmp_path, dtype="float32")
    stamp = a.stat().st_mtime_ns
    assert converted(path, tmp_path, dtype="float32") == a and a.stat().st_mtime_ns == stamp
    b = converted(path, tmp_path, dtype="bfloat16")
    assert b != a and b.stat().st_size < a.stat().st_size  # the experts in 2 bytes, not 4


def test_placement_arithmetic_by_hand():
    """qwen3-moe-tiny in float32 (hidden 64, 4 heads and 2 KV heads of 16, 16 experts of 32, top 4,
    vocab 512, 3 layers), counted by hand. Catches a term dropped or counted twice, the token
    embedding placed on the device (llama.cpp keeps it on the host), the KV cache not padded."""
    config = moe_config("qwen3-moe-tiny")
    per = layer_bytes(config, dtype="float32")
    assert per["experts"] == 3 * 16 * 32 * 64 * 4
    # q, k, v, o in float32; two norms (64), q and k norms (16 each) and the router (16 x 64) in float32
    assert per["rest"] == (2 * 64 * 64 + 2 * 32 * 64) * 4 + (2 * 64 + 2 * 16 + 16 * 64) * 4
    assert kv_cells(batch=2, capacity=32) == 256 and kv_cells(batch=9, capacity=32) == 512
    base = dict(dtype="float32", context=0, batch=2, capacity=32)
    output = 512 * 64 * 4 + 64 * 4
    kv = 2 * 3 * 256 * 2 * 16 * 2
    work = working_bytes(config, batch=2, capacity=32)
    full = 3 * per["rest"] + 3 * per["experts"] + output + kv + work
    p = choose_placement(config, {}, allowance=full, **base)
    assert (p.n_cpu_moe, p.chosen, p.weights_gpu, p.weights_host, p.kv, p.needed) == \
        (0, True, full - kv - work, 512 * 64 * 4, kv, full)
    two = choose_placement(config, {}, allowance=full - per["experts"] - 1, **base)  # one layer's experts short
    assert (two.n_cpu_moe, two.weights_host) == (2, 512 * 64 * 4 + 2 * per["experts"])
    given = choose_placement(config, {"n_cpu_moe": 3}, allowance=full, **base)
    assert (given.n_cpu_moe, given.chosen) == (3, False)
    with pytest.raises(PlacementRefused, match="n_cpu_moe 4 is more than the model's 3 layers"):
        choose_placement(config, {"n_cpu_moe": 4}, allowance=full, **base)
    with pytest.raises(PlacementRefused, match="with n_cpu_moe 0 needs .* raise n_cpu_moe"):
        choose_placement(config, {"n_cpu_moe": 0}, allowance=full - 1, **base)
    with pytest.raises(PlacementRefused, match="even with every layer's experts in host memory"):
        choose_placement(config, {}, allowance=full - 3 * per["experts"] - 1, **base)


def test_the_plan_counts_bytes_by_llama_cpps_rules():
    """Decode: each host layer's float32 expert output comes up, no weight; a prefill of 32 tokens or
    more with op offload on copies the host layers' experts (at most all of them); off, never."""
    config = moe_config("qwen3-moe-tiny", dtype="float16")
    s = shape_of_config(config)
    layer_all = 16 * 3 * 32 * 64 * 2
    on = {"n_cpu_moe": 2, "op_offload": "on"}
    assert call_bytes(s, "float16", "llama-cpp", tokens=1, phase="decode", params=on) == 2 * 64 * 4
    assert call_bytes(s, "float16", "llama-cpp", tokens=31, phase="prefill", params=on) == 2 * 31 * 64 * 4
    assert call_bytes(s, "float16", "llama-cpp", tokens=32, phase="prefill", params=on) == 2 * (32 * 64 * 4 + layer_all)
    # omitted: off, packbench's default (the faster measured)
    assert call_bytes(s, "float16", "llama-cpp", tokens=32, phase="prefill", params={"n_cpu_moe": 2}) == 2 * 32 * 64 * 4
    assert call_bytes(s, "float16", "llama-cpp", tokens=1, phase="decode", params={"n_cpu_moe": 0}) == 0


def _ctx(config=None) -> RecordContext:
    return RecordContext(allowance_bytes=1024 * MIB, dtype="float32", batch=2, capacity=32, cuda=False, config=config)


def test_an_edited_placement_disagrees():
    """A placement recorded as the worker writes it passes; each edit is named: a sum that does not
    add up, an n_cpu_moe that is not the condition's, chosen where the condition gave it, a
    placement over the allowance, and (with the synthetic shape known) one the rule would not choose."""
    config = moe_config("qwen3-moe-tiny")
    p = choose_placement(config, {}, dtype="float32", allowance=1024 * MIB, context=0, batch=2, capacity=32)
    good = {"offload": {"placement": p.as_dict()}}
    assert record_problems({}, good, _ctx(config)) == []

    def edited(**changes) -> dict:
        return {"offload": {"placement": {**p.as_dict(), **changes}}}

    assert "needed recorded" in record_problems({}, edited(needed=1), _ctx())[0]
    assert any("n_cpu_moe 0 is not the protocol's 2" in x for x in record_problems({"n_cpu_moe": 2}, good, _ctx()))
    assert any("chosen True is not the protocol's False" in x
               for x in record_problems({"n_cpu_moe": 0}, good, _ctx()))
    over = LlamaPlacement(**{**{k: v for k, v in p.as_dict().items() if k != "needed"}, "kv": 1024 * MIB})
    assert any("over the allowance" in x for x in record_problems({}, {"offload": {"placement": over.as_dict()}},
                                                                  _ctx()))
    lazy = LlamaPlacement(**{**{k: v for k, v in p.as_dict().items() if k != "needed"}, "n_cpu_moe": 1})
    assert any("llama.cpp's placement of this model" in x
               for x in record_problems({}, {"offload": {"placement": lazy.as_dict()}}, _ctx(config)))
    assert "not llama.cpp's placement" in record_problems({}, {"offload": {"placement": "all"}}, _ctx())[0]


def _raw(path, **changes) -> dict:
    return {"name": "llama-cpp", "model": {"path": str(path)}, "dtype": "float32",
            "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 16, "continuation_tokens": 4,
            "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}, {"policy": "host-experts"},
                           {"name": "llama-cpp", "policy": "llama-cpp"},
                           {"name": "llama-cpp-host", "policy": "llama-cpp", "params": {"n_cpu_moe": 3}}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 1024,
            "gates": {"faithfulness": {}, "fidelity": {"max_mean_kl": 0.001, "min_top1": 0.99}}, **changes}


@pytest.fixture(scope="module")
def screen(tmp_path_factory, moe):
    path = tmp_path_factory.mktemp("llama-cpp-screen") / "screen.zip"
    body, episodes, verdicts = archive_screen(freeze(_raw(moe["qwen3-moe-tiny"])), moe["qwen3-moe-tiny"], path)
    return body, episodes, verdicts, path


def test_the_screen_judges_llama_cpp_by_fidelity_in_its_tier(screen):
    body, episodes, verdicts, _ = screen
    assert body["schema"] == 11  # llama-cpp is sayable from schema 11
    assert [c["params"] for c in body["conditions"] if c["policy"] == "llama-cpp"] == \
        [{"mode": "eager"}, {"mode": "eager", "n_cpu_moe": 3}]  # op_offload omitted means off
    assert all(e["status"] == "ok" for e in episodes), [e.get("error") for e in episodes]
    ours = [e for e in episodes if e["policy"] == "llama-cpp"]
    assert {e["tier"] for e in ours} == {"approximate"} and all(e["forced_from"] is not None for e in ours)
    placed = {e["condition"]: e["offload"]["placement"] for e in ours}
    assert placed["llama-cpp"]["chosen"] and placed["llama-cpp"]["n_cpu_moe"] == 0  # all fits in 1024 MiB
    assert not placed["llama-cpp-host"]["chosen"] and placed["llama-cpp-host"]["n_cpu_moe"] == 3
    assert all(e["offload"]["gguf_bytes"] > 0 and e["offload"]["flash_attn"] is False for e in ours)
    by_gate = {(v["gate"], v["condition"]): v for v in verdicts}
    for name in ("llama-cpp", "llama-cpp-host"):
        assert ("faithfulness", name) not in by_gate
        assert by_gate[("fidelity", name)]["passed"], by_gate[("fidelity", name)]


def test_the_report_shows_the_placement_the_worker_chose(screen):
    """A condition that left n_cpu_moe to the worker reads as the value its episodes recorded, not
    `n_cpu_moe=None` (what the report printed before)."""
    from packbench.core.report import condition_summary, read_screen

    *_, path = screen
    rows = {r["condition"]: r["params"] for r in condition_summary(read_screen(path))}
    assert rows["llama-cpp"] == "n_cpu_moe=0 (chosen), op_offload=off, mode=eager"
    assert rows["llama-cpp-host"] == "n_cpu_moe=3, op_offload=off, mode=eager"


def test_the_screen_audits_agree_and_an_edited_placement_disagrees(screen, tmp_path):
    """Resealed over an edited record (every digest valid), the auditor names the edit itself."""
    from cpu_screen import resealed
    from packbench.core.canonical import canonical_json

    _, episodes, _, path = screen
    assert audit_archive(path).agrees, audit_archive(path).record["problems"]
    ep = next(e for e in episodes if e["condition"] == "llama-cpp-host" and e["role"] == "scored")
    member = f"episodes/{ep['plan_index']:05d}.json"

    def edit(members):
        rec = json.loads(members[member])
        rec["offload"]["placement"]["n_cpu_moe"] = 1
        members[member] = canonical_json(rec)

    report = audit_archive(resealed(path, tmp_path / "forged.zip", edit))
    assert not report.agrees
    assert any(p.startswith(f"{member}: offload.placement: n_cpu_moe 1 is not the protocol's 3")
               for p in report.record["problems"]), report.record["problems"]


def test_refusals_are_one_line_naming_the_field(moe, tiny):
    path = moe["qwen3-moe-tiny"]
    check_family(freeze(_raw(path)))  # fits: nothing raised
    bad = _raw(path, conditions=[{"policy": "dense-stream"}, {"policy": "llama-cpp", "params": {"n_cpu_moe": 4}}])
    with pytest.raises(ProtocolError, match=r"conditions\[1\].params.n_cpu_moe`: .*n_cpu_moe 4 is more than"):
        check_family(freeze(bad))
    small = _raw(path, allowance_mib=1, conditions=[{"policy": "dense-stream"}, {"policy": "llama-cpp"}])
    with pytest.raises(ProtocolError, match=r"allowance_mib"):
        check_family(freeze(small))
    opt = _raw(tiny, conditions=[{"policy": "dense-stream"}, {"policy": "llama-cpp"}])
    with pytest.raises(ProtocolError, match=r"'llama-cpp' does not fit checkpoint .*, an OPT model"):
        check_family(freeze(opt))


def _synth_protocol(tmp_path, params: dict) -> Path:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({
        "name": "llama-synth", "model": {"synth": {"shape": "qwen3-moe-tiny", "dtype": "float32", "seed": 0}},
        "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": 1}}, "prefix_tokens": 40,
        "continuation_tokens": 2, "conditions": [{"policy": "dense-stream"}, {"policy": "llama-cpp", "params": params}],
        "reference": "dense-stream", "allowance_mib": 1024, "gates": {"fidelity": {"max_mean_kl": 0.01}}}))
    return f


def test_protocol_plan_prints_llama_cpps_bytes_with_n_cpu_moe_omitted(tmp_path):
    """`protocol plan` of a llama-cpp condition that leaves n_cpu_moe to the worker: every layer's host
    traffic at most (bug caught on an H100: the plan compared None with the layer count, a traceback)."""
    import json

    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "plan", "--json", str(_synth_protocol(tmp_path, {"op_offload": "on"}))],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-800:]
    row = next(m for m in json.loads(r.stdout)["moe"] if m["policy"] == "llama-cpp")
    layer_all = 16 * 3 * 32 * 64 * 4  # qwen3-moe-tiny, float32: a layer's experts
    assert row["decode_bytes"] == 3 * 64 * 4 and row["prefill_bytes"] == 3 * (40 * 64 * 4 + layer_all)
    assert row["bound"] == "at most"


def test_a_synthetic_shape_refuses_more_host_layers_than_it_has(tmp_path):
    r = subprocess.run([sys.executable, "-m", "packbench", "protocol", "validate",
                        str(_synth_protocol(tmp_path, {"n_cpu_moe": 9}))], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("error: protocol field `conditions[1].params.n_cpu_moe`: condition policy "
                                                 "llama-cpp: n_cpu_moe 9 is more than the model's 3 layers; give at most 3")


def test_a_checkpoint_missing_an_expert_is_one_line(moe, tmp_path):
    """config.json saying 17 experts over a checkpoint of 16: the conversion names the first missing
    tensor and the count, instead of a KeyError from safetensors."""
    import shutil

    from packbench.engine.llama_cpp import LlamaCppUnavailable, write_gguf

    bad = tmp_path / "bad"
    shutil.copytree(moe["qwen3-moe-tiny"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_experts"] = 17
    config.pop("num_local_experts", None)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(LlamaCppUnavailable, match=r"lacks tensor model.layers.0.mlp.experts.16.gate_proj.weight "
                                                  r"\(and 8 more\) that a qwen3_moe GGUF needs"):
        write_gguf(bad, tmp_path / "x.gguf", dtype="float32")
    assert not (tmp_path / "x.gguf").exists()


def test_a_re_execution_runs_the_archived_placement(moe, tmp_path):
    """The auditor's re-execution hands the archived `offload` section over: llama.cpp is placed as the
    archive says (2 host layers, chosen) though this worker's allowance would choose none; a placement
    this device cannot hold is PlacementDoesNotFit (the episode not judged), not another placement."""
    from packbench.core.errors import PlacementDoesNotFit
    from packbench.engine.llama_cpp import LlamaCppModel

    def build(allowance: int):
        return LlamaCppModel(moe["qwen3-moe-tiny"], dtype=torch.float32, device=torch.device("cpu"), params={},
                             allowance_bytes=allowance, context_bytes=0, capacity=32, batch=2, cache=tmp_path,
                             threads=1, archived={"placement": {"n_cpu_moe": 2, "chosen": True}})

    model = build(1 << 30)
    assert (model.plan.n_cpu_moe, model.plan.chosen) == (2, True)
    assert model.stats.placement["n_cpu_moe"] == 2
    with pytest.raises(PlacementDoesNotFit, match="archived llama.cpp placement"):
        build(1 << 20)


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_the_gguf_takes_what_transformers_fills_in_for_keys_config_json_leaves_out(moe, tmp_path):
    """A config.json without its rms epsilon and rotary base: the reference runs with transformers'
    defaults for both, and so must the GGUF (catches a converter that reads config.json itself and
    fails, or guesses other values: a rotary base off by 100x misses the reference)."""
    def drop(config):
        config.pop("rms_norm_eps")
        config.pop("rope_parameters", None)
        config.pop("rope_theta", None)

    path = _edited_copy(moe["qwen3-moe-tiny"], tmp_path / "bare", drop)
    figures, _ = _against_reference(path, _llama(path, tmp_path / "cache"))
    assert all(f.top1 == 1.0 and f.mean_kl < 1e-3 for f in figures), figures


def test_a_scaled_rotary_embedding_is_refused_in_one_line(moe, tmp_path):
    from packbench.engine.llama_cpp import LlamaCppUnavailable

    def linear(config):
        config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}

    path = _edited_copy(moe["qwen3-moe-tiny"], tmp_path / "linear", linear)
    with pytest.raises(LlamaCppUnavailable, match="plain rotary embeddings only, this checkpoint's rope type is 'linear'"):
        _llama(path, tmp_path / "cache")


def test_the_cxx_runtime_is_made_global_before_llama_cpp_is_imported(monkeypatch):
    # Catches library() importing llama_cpp before libstdc++ is global: llama-cpp-python opens its
    # libraries RTLD_GLOBAL, a CUDA build's libggml-cuda exports the runtime's stream instances, and
    # bound first they crashed llama.cpp's print_info in a plain process on an H100. And a machine
    # without a libstdc++ of that name still imports it (the promotion is skipped, not an error).
    from packbench.engine import llama_cpp

    calls = []

    def cdll(name, mode=0):
        calls.append(("dlopen", name, mode))
        raise OSError("not here")

    monkeypatch.setattr(llama_cpp.ctypes, "CDLL", cdll)
    monkeypatch.setattr(llama_cpp.importlib, "import_module", lambda name: calls.append(("import", name)) or name)
    assert llama_cpp.library() == "llama_cpp"
    assert calls == [("dlopen", "libstdc++.so.6", llama_cpp.ctypes.RTLD_GLOBAL), ("import", "llama_cpp")]
