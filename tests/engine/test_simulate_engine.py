"""`packbench simulate` against the engine: tiny OPT and MoE checkpoints run by the CPU-first
engine under every loader policy with tracing on, then the trace, written and read back,
replayed by core/simulate.py; every ledger field of every call and layer must be equal."""

import numpy as np
import pytest
import torch

from packbench.core import simulate as sim
from packbench.core.trace import read_trace, write_trace
from packbench.engine.episode import run_episode
from packbench.engine.tracing import Tracer, record_trace

PROMPTS = [list(range(2, 20)), list(range(30, 48))]
CONTINUATION = 5
OPT_RUNS = [("resident", {}), ("dense-stream", {}), ("packet", {}), ("packet", {"gather": "device"}),
            ("phase-switched", {}), ("phase-switched", {"gather": "device"}), ("sparse-extents", {"block_rows": 4}),
            ("row-retention", {"rows_per_layer": 16}), ("early-forecast", {}), ("early-forecast", {"gather": "device"}),
            ("packet", {"weights": "int8"}), ("packet", {"gather": "device", "weights": "int8"}),
            ("dense-stream", {"weights": "int8"})]
MOE_RUNS = [("resident", {}), ("dense-stream", {}), ("packet", {}), ("packet", {"gather": "device"}),
            ("phase-switched", {}), ("phase-switched", {"gather": "device"}),
            ("packet", {"gather": "mapped"}), ("phase-switched", {"gather": "mapped"})]


def engine_and_simulation(model, runs, tmp_path):
    """Per run: (the engine's calls as dicts, the simulated calls), episodes run as a screen does
    (a fresh policy each), the trace of that very run written to a file and read back."""
    out = []
    for i, (name, params) in enumerate(runs):
        tracer = Tracer(model, source={"run": name})
        engine = []
        for prompt in PROMPTS:
            model.use(name, **params)
            engine += [c.to_dict() for c in run_episode(model, prompt, continuation=CONTINUATION).calls]
        tracer.close()
        trace = read_trace(write_trace(tracer.trace(), tmp_path / f"{i}.trace"))
        out.append((name, params, engine, sim.ledger(trace, name, params), trace, list(getattr(model, "routes", []))))
    return out


def assert_equal_call_by_call(results):
    for name, params, engine, simulated, trace, _ in results:
        assert len(engine) == len(simulated) == len(PROMPTS) * CONTINUATION, (name, params)
        for e, s in zip(engine, simulated):
            for key in ("phase", "tokens", *sim.LEDGER_KEYS):
                # Catches a simulated policy whose bytes, rows, readbacks, waste or observed counts
                # drift from the engine's, in any call or layer (one layer off, a charge missing).
                assert e[key] == s[key], (name, params, e["index"], key, e[key], s[key])


def test_every_opt_policy_simulated_equals_the_engine(tiny, tmp_path):
    from packbench.engine.model import CpuFirstModel

    torch.set_num_threads(1)
    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    results = engine_and_simulation(model, OPT_RUNS, tmp_path)
    assert_equal_call_by_call(results)
    traces = [r[4] for r in results]
    # The sets do not depend on the policy (every policy's logits are the same bits): a tracer
    # that read a policy's workspace instead of the activity would differ here.
    first = [[s.tolist() for s in row] for row in traces[0].sets]
    assert all([[s.tolist() for s in row] for row in t.sets] == first for t in traces)
    assert [c.episode for c in traces[0].calls] == [0] * CONTINUATION + [1] * CONTINUATION
    # Not vacuous: the retention cache hit, the forecast wasted rows, and decode moved fewer rows than prefill.
    by = {(r[0], tuple(r[1].items())): r for r in results}
    retention = sim.totals(by[("row-retention", (("rows_per_layer", 16),))][3])
    assert retention["decode"]["hits"] > 0
    assert sim.totals(by[("early-forecast", ())][3])["decode"]["rows_wasted"] > 0
    assert traces[0].model.units == 256 and traces[0].model.unit_bytes == 64 * 4  # tiny: ffn 256, hidden 64, float32


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_every_moe_policy_simulated_equals_the_engine(shape, tmp_path):
    from packbench.engine.moe.model import CpuFirstMoE
    from packbench.engine.moe.synth import synth_moe

    torch.set_num_threads(1)
    path = synth_moe(tmp_path / shape, shape=shape, seed=3, dtype="float32")
    model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    results = engine_and_simulation(model, MOE_RUNS, tmp_path)
    assert_equal_call_by_call(results)
    name, params, engine, simulated, trace, routes = results[2]  # packet {gather: host}: the model keeps its routes
    # The tracer's sets are the routed experts the model itself read back (CpuFirstMoE.routes: the last episode's).
    last = trace.sets[-CONTINUATION:]
    assert [[tuple(s.tolist()) for s in row] for row in last] == [list(r) for r in routes]
    assert trace.model.unit == "expert" and trace.model.shape == shape and trace.model.k > 0


def test_record_trace_runs_the_prompts_as_episodes(tiny):
    t = record_trace(tiny, PROMPTS, continuation=3, dtype=torch.float32, source={"tool": "test"})
    # Catches a recorder that merges episodes or loses the prefill's token count.
    assert [(c.episode, c.phase, c.tokens) for c in t.calls] == [
        (0, "prefill", 18), (0, "decode", 1), (0, "decode", 1), (1, "prefill", 18), (1, "decode", 1), (1, "decode", 1)]
    assert t.source["tool"] == "test" and t.source["checkpoint"] == str(tiny)


def cache_runs(k: int) -> list[tuple[str, dict]]:
    """expert-cache lru and lfu at capacities k and 2k (a decode call's routing, and twice it),
    forecast off and on, and expert-forecast."""
    runs = [("expert-cache", {"capacity": c, "rule": rule, "forecast": f})
            for c in (k, 2 * k) for rule in ("lru", "lfu") for f in ("off", "on")]
    return runs + [("expert-forecast", {})]


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny"])
def test_expert_caches_and_forecasts_simulated_equal_the_engine(shape, tmp_path):
    from packbench.core.moe import MOE_SHAPES
    from packbench.engine.moe.model import CpuFirstMoE
    from packbench.engine.moe.synth import synth_moe

    torch.set_num_threads(1)
    path = synth_moe(tmp_path / shape, shape=shape, seed=3, dtype="float32")
    model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    check_caches_against_simulation(model, cache_runs(MOE_SHAPES[shape]["k"]), tmp_path)


def check_caches_against_simulation(model, runs, tmp_path) -> list:
    """Every run's engine ledger, counts and forecast sets against its trace's simulation, call by
    call and layer by layer, and every run's logits dense-stream's bits. The runs end with
    expert-forecast; the results as engine_and_simulation gives them."""
    model.use("dense-stream")
    reference = [run_episode(model, prompt, continuation=CONTINUATION).logits for prompt in PROMPTS]
    out, records = [], []
    for i, (name, params) in enumerate(runs):
        tracer = Tracer(model, source={"run": name})
        engine, experts = [], []
        for prompt, ref in zip(PROMPTS, reference):
            model.use(name, **params)
            episode = run_episode(model, prompt, continuation=CONTINUATION)
            # Catches a prefetch that lands in the workspace the forecasting layer still reads.
            assert np.array_equal(episode.logits, ref), (name, params)
            engine += [c.to_dict() for c in episode.calls]
            experts.append(model.expert_record())
        tracer.close()
        trace = read_trace(write_trace(tracer.trace(), tmp_path / f"{i}.trace"))
        out.append((name, params, engine, sim.ledger(trace, name, params), trace, []))
        records.append(experts)
    assert_equal_call_by_call(out)
    for (name, params, engine, simulated, trace, _), experts in zip(out, records):
        # The forecast sets the trace recorded are the ones the engine's policy forecast (the same
        # CpuFirstMoE.forecast): a tracer that read another hidden state would differ here.
        if sim.needs_forecast(name, params):
            counted = [call for record in experts for call in record["counted"]]
            assert [[None if n is None else n.get("forecast") for n in call] for call in counted] == [
                [f.tolist() if f.size else None for f in row] for row in trace.forecasts], (name, params)
        for ep, record in enumerate(experts):
            mine = [c for c in simulated if c["episode"] == ep]
            assert len(mine) == len(record["counted"]) == CONTINUATION
            for c, (s, counted) in enumerate(zip(mine, record["counted"])):
                for layer, n in enumerate(counted):
                    if n is None:  # a dense layer: nothing counted, nothing replayed
                        assert [s[key][layer] for key in ("hits", "misses", "prefetched", "used", "rows_wasted")] \
                            == [None, None, None, None, 0], (name, params, ep, c, layer)
                        continue
                    # Catches a simulated cache whose tie-break, admission or forecast accounting
                    # differs from the engine's in any call or layer: hits, misses, prefetched,
                    # used and wasted, field by field.
                    want = {"hits": n["hits"], "misses": n["misses"], "prefetched": n.get("prefetched"),
                            "used": n.get("used"), "rows_wasted": n.get("wasted", 0)}
                    got = {key: s[key][layer] for key in ("hits", "misses", "prefetched", "used")}
                    got["rows_wasted"] = s["rows_wasted"][layer]
                    assert got == want, (name, params, ep, c, layer)
            # Belady's hits and the episode's totals: the simulation's per-call figures sum to
            # the engine's record (its replay of its own routing).
            for key, rec in (("hits", "hits"), ("misses", "misses"), ("belady_hits", "belady_hits"),
                             ("rows_wasted", "wasted")):
                assert sum(v or 0 for c in mine for v in c[key]) == record[rec], (name, params, ep, key)
            decode = [c for c in mine if c["phase"] == "decode"]
            assert sum(v or 0 for c in decode for v in c["belady_hits"]) == record["decode"]["belady_hits"]
    # Not vacuous: some cache hit, some forecast was used and some wasted.
    lru = sim.totals(out[0][3])["decode"]
    assert lru["hits"] > 0 and lru["misses"] > 0 and lru["belady_hits"] >= lru["hits"]
    forecast = sim.totals(out[-1][3])
    assert forecast["decode"]["used"] > 0 and forecast["decode"]["prefetched"] > forecast["decode"]["used"]
    return out


def qwen3_with_dense_layers(path, **layout):
    """A tiny Qwen3-MoE (4 layers, 6 experts, k 2) whose dense layers `layout` places
    (`decoder_sparse_step`, `mlp_only_layers`), written by transformers' own save."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=6,
                            num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
                            tie_word_embeddings=False, **layout)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("layout, moe_layers, forecast_layers", [
    ({"decoder_sparse_step": 2}, [1, 3], [3]),
    ({"mlp_only_layers": [1]}, [0, 2, 3], [2, 3]),
    ({"mlp_only_layers": [0, 2]}, [1, 3], [3]),
])
def test_forecasts_reach_the_next_layer_with_experts_past_dense_layers(layout, moe_layers, forecast_layers,
                                                                       tmp_path):
    """Bug caught: on a Qwen3-MoE whose MoE layers are not adjacent (`decoder_sparse_step` 2,
    `mlp_only_layers`), the forecast was layer l+1's router, so a layer followed by a dense one
    forecast nothing: expert-forecast (and expert-cache forecast on) never prefetched into the MoE
    layer after a dense one (with decoder_sparse_step 2, never at all) while called a forecast.
    The forecast is the next layer with experts' router on layer l's MoE input; the engine, the
    trace's forecast sets and simulate's replay agree call by call, and the logits stay
    dense-stream's bits (the MoE layers alternate workspaces in their own order)."""
    from packbench.engine.moe.model import CpuFirstMoE

    torch.set_num_threads(1)
    model = CpuFirstMoE(qwen3_with_dense_layers(tmp_path / "q", **layout), dtype=torch.float32,
                        device=torch.device("cpu"))
    assert [i for i, e in enumerate(model.experts_modules) if e is not None] == moe_layers
    out = check_caches_against_simulation(model, cache_runs(2), tmp_path)
    for name, params, engine, simulated, trace, _ in out:
        if not sim.needs_forecast(name, params):
            continue
        for c, (call, replayed) in enumerate(zip(engine, simulated)):
            # Every MoE layer after the first received a forecast: its readback (the routing's 6
            # bytes and the forecast's 6), its set in the trace, its replayed prefetch.
            assert call["d2h_bytes"] == [12 if layer in forecast_layers else 6 if layer in moe_layers else 0
                                         for layer in range(4)], (name, params, c)
            assert [layer for layer in range(4) if trace.forecasts[c][layer].size] == forecast_layers
            assert [layer for layer in range(4) if replayed["prefetched"][layer] is not None] == forecast_layers
        assert trace.version == 3
    decode = sim.totals(out[-1][3])["decode"]  # expert-forecast
    assert decode["prefetched"] > 0 and decode["used"] > 0
    assert [model.forecast_target(layer) for layer in moe_layers] == [*forecast_layers, None]
