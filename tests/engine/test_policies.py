"""Every loader policy, the same assertions: exact logits, exact ledgers (CPU twins of GPU checks)."""

import numpy as np
import pytest
import torch

from engine.checkpoint import build_model
from engine.episode import run_episode
from engine.model import CpuFirstModel
from engine.policies import POLICIES
from engine.shapes import SHAPES

PROMPT = [2] + list(range(10, 41))  # 32 tokens
CONTINUATION = 6


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runs(request, checkpoints):
    """One CPU-first model per dtype, every policy run on the same prompt."""
    dtype = request.param
    model = CpuFirstModel(checkpoints[dtype], dtype=getattr(torch, dtype), device=torch.device("cpu"))
    outs = {}
    for name in POLICIES:
        model.use(name)
        outs[name] = run_episode(model, PROMPT, continuation=CONTINUATION)
    return dtype, model, outs


def test_every_policy_is_bit_identical_to_dense_stream(runs):
    _, _, outs = runs
    ref = outs["dense-stream"]
    assert ref.logits.shape == (CONTINUATION, SHAPES["tiny"]["vocab"])
    for name, out in outs.items():
        assert np.array_equal(out.logits, ref.logits), name
        assert out.tokens == ref.tokens, name


def test_tokens_match_stock_transformers_generate(runs, checkpoints):
    dtype, _, outs = runs
    stock = build_model(checkpoints[dtype], dtype=getattr(torch, dtype))
    ids = stock.generate(torch.tensor([PROMPT]), max_new_tokens=CONTINUATION, do_sample=False, min_new_tokens=CONTINUATION)
    assert outs["packet"].tokens == ids[0, len(PROMPT):].tolist()


def test_dense_stream_ledger_is_calls_x_layers_x_weight_bytes(runs):
    dtype, model, outs = runs
    s = SHAPES["tiny"]
    weight_bytes = s["hidden"] * s["ffn"] * getattr(torch, dtype).itemsize
    calls = outs["dense-stream"].calls
    assert len(calls) == CONTINUATION
    assert sum(sum(c.h2d_weight_bytes) for c in calls) == CONTINUATION * s["layers"] * weight_bytes
    assert all(sum(c.h2d_index_bytes) == 0 and sum(c.d2h_bytes) == 0 for c in calls)
    assert [c.phase for c in calls] == ["prefill"] + ["decode"] * (CONTINUATION - 1)
    assert [c.tokens for c in calls] == [len(PROMPT)] + [1] * (CONTINUATION - 1)


def test_resident_moves_nothing(runs):
    _, _, outs = runs
    assert all(sum(c.h2d_weight_bytes) == 0 for c in outs["resident"].calls)


def test_packet_ledger_equals_independently_counted_active_rows(runs):
    """Count active neurons with forward hooks on a stock model, independent of the policy code."""
    dtype, model, outs = runs
    out = outs["packet"]
    stock = build_model(model_dir_of(model), dtype=getattr(torch, dtype))
    counts: list[list[int]] = []
    per_call: list[int] = []

    def hook(module, args, output):  # fc2's input is the post-ReLU activation (n_tokens, ffn)
        per_call.append(int((args[0] != 0).any(dim=0).sum()))

    for layer in stock.model.decoder.layers:
        layer.fc2.register_forward_hook(hook)
    ids = torch.tensor([PROMPT])
    cache = model.new_cache()
    with torch.inference_mode():
        for token in [None] + out.tokens[:-1]:
            per_call.clear()
            feed = ids if token is None else torch.tensor([[token]])
            stock(input_ids=feed, use_cache=True, **{model._cache_kw: cache})
            counts.append(list(per_call))
    row_bytes = SHAPES["tiny"]["hidden"] * getattr(torch, dtype).itemsize
    assert [c.active_rows for c in out.calls] == counts
    assert [c.rows_copied for c in out.calls] == counts
    for call, active in zip(out.calls, counts):
        assert call.h2d_weight_bytes == [k * row_bytes for k in active]
        assert call.h2d_index_bytes == [k * 8 for k in active]
        assert call.d2h_bytes == [k * 8 for k in active]
    # The synthetic sparsity is real: a decode token activates about 6 % of neurons.
    decode = [k for c in counts[1:] for k in c]
    assert 0 < np.mean(decode) / SHAPES["tiny"]["ffn"] < 0.15


def model_dir_of(model: CpuFirstModel):
    return model.model_dir
