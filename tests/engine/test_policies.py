"""Every loader policy, the same assertions: exact logits, exact ledgers (CPU twins of GPU checks)."""

import numpy as np
import pytest
import torch

from packbench.engine.checkpoint import build_model
from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.conditions import POLICIES
from packbench.core.registry import SHAPES
from packbench.engine.synth import synth_checkpoint

CONTINUATION = 5
PREFILLS = (1, 64)
PARAMS = {"sparse-extents": {"block_rows": 16}, "row-retention": {"rows_per_layer": 48}}
# Every policy, plus packet and early-forecast with the device-side gather (on the CPU:
# engine.gather's reference).
VARIANTS = {**{name: (name, PARAMS.get(name, {})) for name in POLICIES},
            "packet+gather=device": ("packet", {"gather": "device"}),
            "early-forecast+gather=device": ("early-forecast", {"gather": "device"}),
            "phase-switched+gather=device": ("phase-switched", {"gather": "device"})}


def prompt_of(length: int, vocab: int) -> list[int]:
    return [2] + [(7 * i + 11) % (vocab - 4) + 4 for i in range(length - 1)]


@pytest.fixture(scope="module")
def checkpoint_profile(tmp_path_factory):
    """The calibrated profile (docs/workloads.md): heavy-tailed rates, peaked logits."""
    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-opt", shape="tiny", dtype="float32", seed=0,
                            profile="opt")


DTYPES = ("float32", "float16", "bfloat16")
# (shape, recipe, dtype): the uniform recipe on two shapes, the calibrated profile on tiny
CASES = [(shape, recipe, dtype) for shape, recipe in (("tiny", "uniform"), ("opt-125m", "uniform"), ("tiny", "opt"))
         for dtype in DTYPES]


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-{r}-{d}" for s, r, d in CASES])
def runs(request, checkpoints, checkpoint_125m, checkpoint_profile):
    """Every policy on both prefill lengths, one CPU-first model per (shape, recipe, dtype)."""
    shape, recipe, dtype = request.param
    path = checkpoint_profile if recipe == "opt" else checkpoints["float32"] if shape == "tiny" else checkpoint_125m
    model = CpuFirstModel(path, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    outs = {}
    for n in PREFILLS:
        prompt = prompt_of(n, model.vocab)
        for key, (name, params) in VARIANTS.items():
            model.use(name, **params)
            outs[key, n] = run_episode(model, prompt, continuation=CONTINUATION)
    return shape, dtype, path, model, outs


def test_every_policy_is_bit_identical_to_dense_stream(runs):
    shape, _, _, _, outs = runs
    for n in PREFILLS:
        ref = outs["dense-stream", n]
        assert ref.logits.shape == (CONTINUATION, SHAPES[shape]["vocab"])
        for name in VARIANTS:
            assert np.array_equal(outs[name, n].logits, ref.logits), (name, n)
            assert outs[name, n].tokens == ref.tokens, (name, n)


def test_tokens_match_stock_transformers_generate(runs):
    _, dtype, path, model, outs = runs
    stock = build_model(path, dtype=getattr(torch, dtype))
    for n in PREFILLS:
        prompt = prompt_of(n, model.vocab)
        ids = stock.generate(torch.tensor([prompt]), max_new_tokens=CONTINUATION, min_new_tokens=CONTINUATION,
                             do_sample=False)
        assert outs["packet", n].tokens == ids[0, n:].tolist(), n


def test_dense_stream_ledger_is_calls_x_layers_x_weight_bytes(runs):
    shape, dtype, _, _, outs = runs
    s = SHAPES[shape]
    weight_bytes = s["hidden"] * s["ffn"] * getattr(torch, dtype).itemsize
    for n in PREFILLS:
        calls = outs["dense-stream", n].calls
        assert sum(sum(c.h2d_weight_bytes) for c in calls) == CONTINUATION * s["layers"] * weight_bytes
        assert all(sum(c.h2d_index_bytes) == 0 and sum(c.d2h_bytes) == 0 for c in calls)
        assert [c.phase for c in calls] == ["prefill"] + ["decode"] * (CONTINUATION - 1)
        assert [c.tokens for c in calls] == [n] + [1] * (CONTINUATION - 1)
    assert all(sum(c.h2d_weight_bytes) == 0 for c in outs["resident", 1].calls)


def count_active_rows(path, dtype, prompt, tokens, cache_kw) -> list[list[int]]:
    """Active neurons per call and layer, counted by hooks on a stock model (independent of policies)."""
    stock = build_model(path, dtype=dtype)
    counts, per_call = [], []
    for layer in stock.model.decoder.layers:
        # fc2's input is the post-ReLU activation (n_tokens, ffn): count columns with any non-zero.
        layer.fc2.register_forward_hook(lambda m, args, out: per_call.append(int((args[0] != 0).any(dim=0).sum())))
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        for token in [None] + tokens[:-1]:
            per_call.clear()
            feed = torch.tensor([prompt]) if token is None else torch.tensor([[token]])
            stock(input_ids=feed, use_cache=True, **{cache_kw: cache})
            counts.append(list(per_call))
    return counts


def test_packet_ledgers_equal_independently_counted_active_rows(runs):
    shape, dtype, path, model, outs = runs
    s = SHAPES[shape]
    row_bytes = s["hidden"] * getattr(torch, dtype).itemsize
    for n in PREFILLS:
        out = outs["packet", n]
        counts = count_active_rows(path, getattr(torch, dtype), prompt_of(n, model.vocab), out.tokens, model._cache_kw)
        for name in POLICIES:
            if name in ("resident", "dense-stream"):
                continue
            calls = outs[name, n].calls
            if name == "phase-switched":  # a dense prefill does not look at activity
                assert calls[0].active_rows == [None] * s["layers"] and calls[0].d2h_bytes == [0] * s["layers"]
                calls, expected = calls[1:], counts[1:]
            else:
                expected = counts
            assert [c.active_rows for c in calls] == expected, name
            assert all(c.d2h_bytes == [s["ffn"]] * s["layers"] for c in calls), name  # one bool mask per layer
        for call, active in zip(out.calls, counts):
            assert call.rows_copied == active
            assert call.h2d_weight_bytes == [k * row_bytes for k in active]
            assert call.h2d_index_bytes == [k * 8 for k in active]
        # device gather: same rows, no index, a 4-byte count per layer read once per call
        device = outs["packet+gather=device", n].calls
        assert [c.active_rows for c in device] == counts and [c.rows_copied for c in device] == counts
        assert [c.h2d_weight_bytes for c in device] == [c.h2d_weight_bytes for c in out.calls]
        assert all(c.h2d_index_bytes == [0] * s["layers"] and c.d2h_bytes == [4] * s["layers"] for c in device)
        # phase-switched: dense prefill, packet decode
        ps = outs["phase-switched", n].calls
        assert ps[0].h2d_weight_bytes == [s["ffn"] * row_bytes] * s["layers"]
        assert [c.h2d_weight_bytes for c in ps[1:]] == [c.h2d_weight_bytes for c in out.calls[1:]]
        # ... with the device gather: the same bytes, prefill dense, decode packet's device rows
        psd = outs["phase-switched+gather=device", n].calls
        assert [c.h2d_weight_bytes for c in psd] == [c.h2d_weight_bytes for c in ps]
        assert psd[0].active_rows == [None] * s["layers"] and [c.active_rows for c in psd[1:]] == counts[1:]
        assert all(c.h2d_index_bytes == [0] * s["layers"] and c.d2h_bytes == [4] * s["layers"] for c in psd[1:])
        # sparse-extents: whole 16-row blocks, never fewer rows than packet
        for se, pk in zip(outs["sparse-extents", n].calls, out.calls):
            assert all(r % 16 == 0 and r >= k for r, k in zip(se.rows_copied, pk.rows_copied))
        # early-forecast: copied = demand + wasted; the first call has no forecast
        for call, active in zip(outs["early-forecast", n].calls, counts):
            assert [r - w for r, w in zip(call.rows_copied, call.rows_wasted)] == active
        assert outs["early-forecast", n].calls[0].rows_wasted == [0] * s["layers"]
        # early-forecast on the device: the host's forecasts and remainders, so the same rows,
        # bytes and waste per call and layer; no index, four 4-byte counts per layer read once
        host, device = outs["early-forecast", n].calls, outs["early-forecast+gather=device", n].calls
        for key in ("active_rows", "rows_copied", "h2d_weight_bytes", "rows_wasted"):
            assert [getattr(c, key) for c in device] == [getattr(c, key) for c in host], key
        assert sum(sum(c.rows_wasted) for c in device) > 0  # forecasts were wrong sometimes: the test can tell
        assert all(c.h2d_index_bytes == [0] * s["layers"] and c.d2h_bytes == [16] * s["layers"] for c in device)
    # decode sparsity is real: about 6 % of neurons per token
    decode = [k for c in outs["packet", 1].calls[1:] for k in c.active_rows]
    assert 0 < np.mean(decode) / s["ffn"] < 0.15


def test_row_retention_copies_only_misses(runs):
    shape, _, _, _, outs = runs
    for n in PREFILLS:
        rr, pk = outs["row-retention", n].calls, outs["packet", n].calls
        assert rr[0].rows_copied == pk[0].rows_copied  # a cold cache misses everything
        assert sum(sum(c.rows_copied) for c in rr) <= sum(sum(c.rows_copied) for c in pk)


def active_sets(path, dtype, prompt, tokens, cache_kw) -> list[list[set[int]]]:
    """The active neurons themselves per call and layer, from hooks on a stock model."""
    stock = build_model(path, dtype=dtype)
    per_call: list[set[int]] = []
    for layer in stock.model.decoder.layers:
        layer.fc2.register_forward_hook(
            lambda m, args, out: per_call.append(set((args[0] != 0).reshape(-1, args[0].shape[-1]).any(dim=0)
                                                     .nonzero().flatten().tolist())))
    from transformers import DynamicCache

    cache, sets = DynamicCache(), []
    with torch.inference_mode():
        for token in [None] + tokens[:-1]:
            per_call.clear()
            feed = torch.tensor([prompt]) if token is None else torch.tensor([[token]])
            stock(input_ids=feed, use_cache=True, **{cache_kw: cache})
            sets.append(list(per_call))
    return sets


def test_index_bytes_are_pinned_for_every_policy(runs):
    """h2d_index_bytes per call and layer, from the active sets counted on a stock model and
    each policy's documented transfer (8-byte indices): what every policy charges for indices."""
    shape, dtype, path, model, outs = runs
    s = SHAPES[shape]
    zero = [0] * s["layers"]
    for n in PREFILLS:
        sets = active_sets(path, getattr(torch, dtype), prompt_of(n, model.vocab), outs["packet", n].tokens,
                           model._cache_kw)
        sizes = [[len(a) for a in call] for call in sets]
        for name in ("resident", "dense-stream", "packet+gather=device", "early-forecast+gather=device",
                     "phase-switched+gather=device"):
            assert all(c.h2d_index_bytes == zero for c in outs[name, n].calls), name  # no index crosses
        # packet: one index per active row
        assert [c.h2d_index_bytes for c in outs["packet", n].calls] == [[8 * k for k in call] for call in sizes]
        # phase-switched: none in the dense prefill, packet's in decode
        ps = outs["phase-switched", n].calls
        assert ps[0].h2d_index_bytes == zero
        assert [c.h2d_index_bytes for c in ps[1:]] == [[8 * k for k in call] for call in sizes[1:]]
        # sparse-extents: one index per 16-row block that holds an active row
        blocks = [[len({j // 16 for j in a}) for a in call] for call in sets]
        se = outs["sparse-extents", n].calls
        assert [c.h2d_index_bytes for c in se] == [[8 * b for b in call] for call in blocks]
        assert [c.rows_copied for c in se] == [[16 * b for b in call] for call in blocks]  # ffn is a multiple of 16
        # early-forecast: decode calls send the previous call's rows (the forecast) then the
        # remainder, each row with its index; the prefill has no forecast
        ef = outs["early-forecast", n].calls
        for i, call in enumerate(ef):
            for layer, active in enumerate(sets[i]):
                forecast = sets[i - 1][layer] if i >= 1 else set()
                rows = len(forecast) + len(active - forecast)
                assert (call.rows_copied[layer], call.rows_wasted[layer], call.h2d_index_bytes[layer]) == \
                    (rows, len(forecast - active), 8 * rows), ("early-forecast", n, i, layer)
        # row-retention: misses carry their index; hits are gathered on the device by a (row,
        # slot) index pair; the rows written into the cache by a slot index. Cold first call: all miss.
        slots = min(PARAMS["row-retention"]["rows_per_layer"], s["ffn"])
        rr = outs["row-retention", n].calls
        assert rr[0].rows_copied == sizes[0] and rr[0].h2d_index_bytes == [8 * (k + min(k, slots)) for k in sizes[0]]
        hits = 0
        for call, active in zip(rr, sizes):
            for miss, k, index in zip(call.rows_copied, active, call.h2d_index_bytes):
                hits += k - miss
                assert index == 8 * (miss + 2 * (k - miss) + min(miss, slots))
        assert hits > 0  # the cache served rows: the pair charge was exercised


def test_sparse_extents_block_rows_above_ffn_makes_no_buffer_of_block_rows(checkpoints):
    """Bug: SparseExtents allocated its row offsets as arange(block_rows), on the host and on the
    device, whatever the layer's ffn; the largest block_rows a protocol accepts (MAX_INT_PARAM)
    asked for 16 GiB, uncharged, and the episode failed. A block above ffn is the whole layer: its
    offsets need at most ffn entries, and the policy then sends every row, dense-stream's bits."""
    from packbench.core.conditions.base import MAX_INT_PARAM

    model = CpuFirstModel(checkpoints["float32"], dtype=torch.float32, device=torch.device("cpu"))
    prompt = prompt_of(8, model.vocab)
    model.use("dense-stream")
    ref = run_episode(model, prompt, continuation=3)
    model.use("sparse-extents", block_rows=MAX_INT_PARAM)
    ffn = model.host.shape[1]
    assert model.slot.policy.buffers.offsets.numel() == ffn
    out = run_episode(model, prompt, continuation=3)
    assert np.array_equal(out.logits, ref.logits)
    for call in out.calls:
        assert call.rows_copied == [ffn if k else 0 for k in call.active_rows]
        assert call.h2d_index_bytes == [8 if k else 0 for k in call.active_rows]


def test_estimate_bounds_hold_for_what_row_retention_and_device_forecast_charge(checkpoints):
    """Bug: `protocol plan` said row-retention moves *at most* packet's bytes, but a cold call
    (every prefill) also writes its fills into the cache by one int64 index each, so it moved
    more; and it said early-forecast {gather: device} moves *at least* packet's bytes, which
    include an int64 index per row that the device gather never sends. Each kind's estimate,
    fed a call and layer's actual active count, must bound what the engine charged there."""
    import dataclasses

    from packbench.core.conditions import CONDITIONS
    from packbench.core.conditions.base import CallInputs
    from packbench.core.estimate import Activity, ModelShape

    model = CpuFirstModel(checkpoints["float32"], dtype=torch.float32, device=torch.device("cpu"))
    ffn = model.host.shape[1]
    one_layer = dataclasses.replace(ModelShape.of("tiny"), layers=1)
    for policy, params, holds in (("row-retention", {"rows_per_layer": 4}, lambda moved, bound: moved <= bound),
                                  ("row-retention", {"rows_per_layer": 10 ** 6}, lambda moved, bound: moved <= bound),
                                  ("early-forecast", {"gather": "device"}, lambda moved, bound: moved >= bound),
                                  ("early-forecast", {"gather": "host"}, lambda moved, bound: moved >= bound)):
        model.use(policy, **params)
        out = run_episode(model, [prompt_of(8, model.vocab), prompt_of(8, model.vocab)[::-1]], continuation=4)
        for call in out.calls:
            for layer, k in enumerate(call.active_rows):
                # one token of activity k / ffn: the estimate's union is exactly the k rows seen
                inputs = CallInputs(phase=call.phase, tokens=1, shape=one_layer, row_bytes=model.host.row_bytes,
                                    activity=Activity(sparsity=1 - k / ffn))
                bound = CONDITIONS[policy].h2d_bytes(params, inputs)
                moved = call.h2d_weight_bytes[layer] + call.h2d_index_bytes[layer]
                assert holds(moved, round(bound, 6)), (policy, params, call.index, layer, moved, bound)
