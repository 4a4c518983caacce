"""Expert caches and forecasts (engine/moe/cache.py): bit-identical to dense-stream in float32,
float16 and bfloat16 on a tiny shape of each family, with ledgers checked exactly against
hand counts (an LRU written here from scratch, the forecast's sets recomputed from the routing),
and the record's figures replayed from its routing (core/expert_cache.py episode_figures).
The CUDA test runs the same on the GPU (side stream, events); the CPU tests are its twins."""

from collections import OrderedDict

import numpy as np
import pytest
import torch

from packbench.core.expert_cache import episode_figures
from packbench.core.moe import MOE_SHAPES
from packbench.engine.episode import run_episode
from packbench.engine.moe.cache import ExpertCache
from packbench.engine.moe.model import CpuFirstMoE
from packbench.engine.moe.synth import synth_moe

SHAPES = ("mixtral-tiny", "qwen3-moe-tiny", "olmoe-tiny")
DTYPES = ("float32", "float16", "bfloat16")
PROMPT = list(range(7, 31))
CONTINUATION = 6
RUNS = (("lru2", "expert-cache", {"capacity": 2}),
        ("lfu3", "expert-cache", {"capacity": 3, "rule": "lfu"}),
        ("forecast", "expert-forecast", {}),
        ("lru4-forecast", "expert-cache", {"capacity": 4, "forecast": "on"}),
        ("all", "expert-cache", {"capacity": 0}))  # capacity 0, no forecast: every routed expert fetched


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe-cache")
    return {(s, d): synth_moe(root / f"{s}-{d}", shape=s, seed=3, dtype=d) for s in SHAPES for d in DTYPES}


def _lru_by_hand(requests: list[tuple[int, ...]], capacity: int) -> list[int]:
    """Hits per request of an LRU over call sets, written independently of core: hits are looked
    up first, then every routed expert is touched in ascending id order *descending* priority (the
    lower id ends most recent), then the least recent are dropped to the capacity."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for need in requests:
        hits.append(sum(1 for e in need if e in cache))
        for e in sorted(need, reverse=True):  # the lowest id touched last: kept on a tie
            cache[e] = None
            cache.move_to_end(e)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _run_all(model: CpuFirstMoE) -> dict:
    model.use("dense-stream")
    outs = {"dense-stream": (run_episode(model, PROMPT, continuation=CONTINUATION), None)}
    for label, kind, params in RUNS:
        model.use(kind, **params)
        out = run_episode(model, PROMPT, continuation=CONTINUATION)
        outs[label] = (out, model.expert_record())
    return outs


def _check_ledgers(outs: dict, *, layers: int, experts: int, expert_bytes: int) -> None:
    for label, kind, params in RUNS:
        out, rec = outs[label]
        capacity, forecasting = params.get("capacity", 0), kind == "expert-forecast" or params.get("forecast") == "on"
        routes = rec["routes"]
        assert len(routes) == CONTINUATION and len(rec["counted"]) == CONTINUATION
        for layer in range(layers):
            requests = [tuple(call[layer]) for call in routes]
            hand_hits = _lru_by_hand(requests, capacity) if params.get("rule", "lru") == "lru" else None
            held_before: set[int] = set()
            for c, (call, counted) in enumerate(zip(out.calls, rec["counted"])):
                routed = set(routes[c][layer])
                n = counted[layer]
                # Catches a cache that counts a routed expert twice or not at all.
                assert n["hits"] + n["misses"] == len(routed) == call.active_rows[layer], (label, c, layer)
                if hand_hits is not None:
                    assert n["hits"] == hand_hits[c], (label, c, layer)
                if forecasting and layer > 0:
                    forecast = set(n["forecast"])
                    # What the cache held before the call: the routed experts that were hits.
                    prefetched = forecast - held_before if capacity else forecast
                    used, wasted = prefetched & routed, prefetched - routed
                    assert (n["prefetched"], n["used"], n["wasted"]) == (len(prefetched), len(used), len(wasted))
                    assert call.rows_wasted[layer] == len(wasted)
                    moved = len(prefetched) + (n["misses"] - len(used))
                    assert call.d2h_bytes[layer] == 2 * experts  # routing and forecast readbacks
                else:
                    assert "forecast" not in n and call.rows_wasted[layer] == 0
                    moved = n["misses"]
                    assert call.d2h_bytes[layer] == experts
                # Bytes = experts moved x expert bytes; the device gather sends no index.
                assert call.rows_copied[layer] == moved, (label, c, layer)
                assert call.h2d_weight_bytes[layer] == moved * expert_bytes
                assert call.h2d_index_bytes[layer] == 0
                if capacity:
                    held_before = _held_after(requests[: c + 1], capacity, params.get("rule", "lru"))
        # The record's totals are a replay of its own routing and forecasts.
        replay = episode_figures(routes, [c.phase for c in out.calls], capacity=capacity,
                                 rule=params.get("rule", "lru"),
                                 forecasts=[[None if n is None else n.get("forecast") for n in call]
                                            for call in rec["counted"]])
        for key in ("routed", "hits", "misses", "prefetched", "used", "wasted", "belady_hits", "hit_rate",
                    "belady_rate", "ready_rate", "decode", "layers"):
            assert rec[key] == replay[key], (label, key)
        counted = sum(n["hits"] for call in rec["counted"] for n in call if n is not None)
        assert rec["hits"] == counted and rec["belady_hits"] >= rec["hits"], label
        assert rec["ready_rate"] == (rec["hits"] + rec["used"]) / rec["routed"]
        assert rec["routed"] == sum(sum(call.active_rows) for call in out.calls)


def _held_after(requests, capacity, rule):
    from packbench.core.expert_cache import LayerCache

    cache = LayerCache(capacity, rule)
    for r in requests:
        cache.step(r)
    return set(cache.cached)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_caches_and_forecasts_are_dense_stream_bit_for_bit_with_exact_ledgers(checkpoints, shape, dtype):
    model = CpuFirstMoE(checkpoints[(shape, dtype)], dtype=getattr(torch, dtype), device=torch.device("cpu"))
    s = MOE_SHAPES[shape]
    outs = _run_all(model)
    ref = outs["dense-stream"][0]
    for label, (out, _) in outs.items():
        # Catches a hit read from a stale or wrong slot, or a prefetch the layer used before it landed.
        assert (out.logits == ref.logits).all(), f"{label} differs from dense-stream in {dtype}"
        assert out.tokens == ref.tokens
    _check_ledgers(outs, layers=s["layers"], experts=s["experts"],
                   expert_bytes=3 * s["hidden"] * s["intermediate"] * getattr(torch, dtype).itemsize)


def test_hits_are_read_from_the_slots(checkpoints):
    """A second episode on the same (warm) cache: with the host copies of every cached layer-0
    expert scrambled the logits stay dense-stream's (hits come from the slots, not the host), and
    with one slot scrambled they move (the slots are really read; exactness does not come from
    fetching everything again)."""
    path = checkpoints[("mixtral-tiny", "float32")]
    model = CpuFirstMoE(path, dtype=torch.float32, device=torch.device("cpu"))
    model.use("dense-stream")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION)
    model.use("expert-cache", capacity=8)
    policy = model.slot.policy
    run_episode(model, PROMPT, continuation=CONTINUATION)
    cached = sorted(policy.caches[0].cached)
    assert set(model.routes[0][0]) <= set(cached)  # the next prefill's layer 0 hits only
    saved = model.host.gate_up[0].clone()
    for e in cached:
        model.host.gate_up[0][e].normal_()
    warm = run_episode(model, PROMPT, continuation=CONTINUATION)
    assert (warm.logits == ref.logits).all()
    model.host.gate_up[0].copy_(saved)
    slots = policy.slots[0]
    slots.gate_up[slots.slot_of[model.routes[0][0][0]]].normal_()
    stale = run_episode(model, PROMPT, continuation=CONTINUATION)
    assert not (stale.logits[0] == ref.logits[0]).all()


def test_device_bytes_charge_slots_and_workspaces(checkpoints):
    model = CpuFirstMoE(checkpoints[("qwen3-moe-tiny", "float32")], dtype=torch.float32, device=torch.device("cpu"))
    layer = model.host.layer_bytes
    for params, want in (({"capacity": 3}, layer + 3 * 3 * model.host.expert_bytes),
                         ({"capacity": 3, "forecast": "on"}, 2 * layer + 3 * 3 * model.host.expert_bytes),
                         ({"capacity": 0}, layer)):
        model.use("expert-cache", **params)
        # Catches a cache whose slots (c x layers experts) or second workspace go uncharged.
        assert model.slot.policy.device_bytes() == want, params
    model.use("expert-forecast")
    assert model.slot.policy.device_bytes() == 2 * layer and model.slot.policy.name == "expert-forecast"


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="forecast must be one of off, on"):
        ExpertCache(capacity=1, forecast="maybe")
    with pytest.raises(ValueError, match="rule must be one of lru, lfu"):
        ExpertCache(capacity=1, rule="mru")


@pytest.mark.gpu
def test_caches_and_forecasts_on_cuda(checkpoints):
    """The CUDA path: pinned host, the forecast on a side stream joined by an event; bit-identical
    to dense-stream in float16 with the same exact ledgers (its CPU twin: the test above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = CpuFirstMoE(checkpoints[("qwen3-moe-tiny", "float16")], dtype=torch.float16, device=torch.device("cuda"))
    s = MOE_SHAPES["qwen3-moe-tiny"]
    model.use("expert-forecast")
    assert model.slot.policy.side is not None  # the prefetch runs on its own CUDA stream
    outs = _run_all(model)
    ref = outs["dense-stream"][0]
    for label, (out, _) in outs.items():
        assert (out.logits == ref.logits).all(), label
    _check_ledgers(outs, layers=s["layers"], experts=s["experts"],
                   expert_bytes=3 * s["hidden"] * s["intermediate"] * 2)


@pytest.mark.parametrize("rule", ("lru", "lfu"))
@pytest.mark.parametrize("forecast", ("off", "on"))
def test_every_routed_expert_reads_its_own_weights_on_any_sequence(rule, forecast):
    """Driven directly over crafted and random routed sets (no model): after `experts`, every
    routed expert of the call reads exactly its host weights, whatever was hit, admitted, evicted
    (a hit evicted for a higher-ranked miss included) or prefetched. Catches a slot reused while
    its expert is still read in the call, or a view that answers another expert's slot."""
    from packbench.engine.ledger import Recorder
    from packbench.engine.moe.host import ExpertHost

    g = torch.Generator().manual_seed(0)
    experts, layers = 6, 2
    host = ExpertHost([torch.randn(experts, 4, 3, generator=g) for _ in range(layers)],
                      [torch.randn(experts, 3, 2, generator=g) for _ in range(layers)], pin=False)
    recorder = Recorder(layers)
    policy = ExpertCache(capacity=2, rule=rule, forecast=forecast)
    policy.activate(host, torch.device("cpu"), recorder)
    # At [1, 2, 4] both rules keep 1 and 2 (equal recency and count: the lower ids) and evict 4,
    # a hit of that very call: its slot is freed while the call still reads expert 4.
    crafted = [[1, 2], [4, 5], [1, 2, 4], [1], [1], [2], [2], [2], [1, 2], [3, 4, 5], [1, 2, 3], [0], [0, 5]]
    rng = np.random.default_rng(1)
    sequence = crafted + [sorted(rng.choice(experts, int(rng.integers(1, 5)), replace=False).tolist())
                          for _ in range(40)]
    evicted_hit = False
    for call, routed in enumerate(sequence):
        recorder.begin(phase="decode", tokens=1)
        for layer in range(layers):
            if layer == 1 and forecast == "on":
                policy.prefetch(1, sorted(rng.choice(experts, 2, replace=False).tolist()))
            held = set(policy.caches[layer].cached)
            gu, dn = policy.experts(layer, routed)
            kept = policy.caches[layer].cached
            evicted_hit |= bool((held & set(routed)) - kept)
            for e in routed:
                assert torch.equal(gu[e], host.gate_up[layer][e]) and torch.equal(dn[e], host.down[layer][e]), \
                    (call, layer, e)
            # Slots hold exactly the cached experts' weights after the call.
            slots = policy.slots[layer]
            assert set(slots.slot_of) == set(kept)
            for e, s in slots.slot_of.items():
                assert torch.equal(slots.gate_up[s], host.gate_up[layer][e])
        recorder.end(wall_s=0.0, logits_d2h_bytes=0)
    assert evicted_hit  # the crafted calls reached the evicted-hit path


def test_the_forecast_is_the_next_routers_choice_on_the_current_input(checkpoints):
    """The forecast for layer l+1 is layer l+1's router applied to the hidden state layer l's
    experts received (only what the model had computed), recomputed here from a hook of our own
    (catches a forecast that peeks at layer l+1's real input or routing, or uses the wrong router)."""
    model = CpuFirstMoE(checkpoints[("qwen3-moe-tiny", "float32")], dtype=torch.float32, device=torch.device("cpu"))
    seen: dict[tuple[int, int], torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, l=layer: seen.__setitem__((model.recorder.current.index, l), args[0].clone()))
        for layer, m in enumerate(model.experts_modules)]
    model.use("expert-forecast")
    run_episode(model, PROMPT, continuation=CONTINUATION)
    for h in hooks:
        h.remove()
    counted = model.slot.policy.counts
    layers = len(model.experts_modules)
    for call in range(CONTINUATION):
        assert "forecast" not in counted[call][0]  # nothing before the first layer
        for layer in range(1, layers):
            gate = model.model.model.layers[layer].mlp.gate
            with torch.inference_mode():
                index = gate(seen[(call, layer - 1)])[2]
            assert counted[call][layer]["forecast"] == sorted(set(index.reshape(-1).tolist())), (call, layer)


def test_an_moe_episode_passes_the_cache_by_the_keyword_its_transformers_takes(checkpoints):
    """The MoE model passed `past_key_values=` where transformers 5.25 takes `cache` (a FutureWarning
    in every `model stats` and worker log; an error from 5.40). Catches the old keyword on a
    release that renamed it, and `cache_keyword` answering from anything but the signature."""
    import warnings

    from packbench.engine.hf import cache_keyword

    class Renamed:
        def forward(self, input_ids=None, cache=None): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None): ...

    assert (cache_keyword(Renamed()), cache_keyword(Old())) == ("cache", "past_key_values")
    model = CpuFirstMoE(checkpoints[("qwen3-moe-tiny", "float32")], dtype=torch.float32, device=torch.device("cpu"))
    assert model._cache_kw == cache_keyword(model.model)
    model.use("dense-stream")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_episode(model, PROMPT, continuation=2)
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]
