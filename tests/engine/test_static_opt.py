"""Mode "graph" on the CPU (the twin of test_graph_cuda.py): packbench's static decoder against
stock transformers, and every policy against dense-stream within the mode."""

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.graph import graph_refusal
from packbench.engine.model import CpuFirstModel
from packbench.engine.conditions import POLICIES

CONTINUATION = 5
PARAMS = {"sparse-extents": {"block_rows": 16}, "row-retention": {"rows_per_layer": 48}}
LEDGER_CHECKED = ("dense-stream", "packet", "packet+gather=device", "row-retention")  # the CPU has 2 cores
VARIANTS = {**{name: (name, PARAMS.get(name, {})) for name in POLICIES},
            "packet+gather=device": ("packet", {"gather": "device"})}


def prompt_of(length: int, vocab: int) -> list[int]:
    return [2] + [(7 * i + 11) % (vocab - 4) + 4 for i in range(length - 1)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tiny_graph_mode_is_bit_identical_to_stock_eager(dtype, checkpoints):
    """On the tiny shape every call's logits equal stock transformers' bit for bit, decode too."""
    model = CpuFirstModel(checkpoints["float32"], dtype=getattr(torch, dtype), device=torch.device("cpu"))
    for n in (1, 64):
        prompt = prompt_of(n, model.vocab)
        model.use("dense-stream")
        stock = run_episode(model, prompt, continuation=CONTINUATION, mode="eager")
        for name, (policy, params) in VARIANTS.items():
            model.use(policy, **params)
            out = run_episode(model, prompt, continuation=CONTINUATION, mode="graph")
            assert out.mode == "graph" and out.decode_graph == "eager: no CUDA graphs on cpu"
            assert np.array_equal(out.logits, stock.logits), (name, n)
            assert out.tokens == stock.tokens, (name, n)
            assert out.kv_bytes == 2 * 2 * 4 * (n + CONTINUATION) * 16 * getattr(torch, dtype).itemsize


@pytest.mark.parametrize("dtype", ["float16"])  # every dtype runs on the tiny shape above; 125m adds the real widths
def test_opt125m_graph_mode_is_bit_identical_to_stock_and_across_policies(dtype, checkpoint_125m):
    model = CpuFirstModel(checkpoint_125m, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    prompt = prompt_of(64, model.vocab)
    model.use("dense-stream")
    stock = run_episode(model, prompt, continuation=CONTINUATION, mode="eager")
    ref = run_episode(model, prompt, continuation=CONTINUATION, mode="graph")
    assert run_episode(model, prompt, continuation=CONTINUATION, mode="graph").logits.tobytes() == ref.logits.tobytes()
    assert np.array_equal(ref.logits, stock.logits) and ref.tokens == stock.tokens
    # Every policy in one dtype; two in the others (the CPU runner has 2 cores).
    names = VARIANTS if dtype == "float16" else ("packet", "packet+gather=device")
    for name in names:
        policy, params = VARIANTS[name]
        model.use(policy, **params)
        out = run_episode(model, prompt, continuation=CONTINUATION, mode="graph")
        assert np.array_equal(out.logits, ref.logits), name
        if name not in LEDGER_CHECKED:
            continue
        model.use(policy, **params)  # fresh: an LRU cache must not carry over
        eager = run_episode(model, prompt, continuation=CONTINUATION, mode="eager")
        assert [c.h2d_weight_bytes for c in out.calls] == [c.h2d_weight_bytes for c in eager.calls], name
        assert [c.active_rows for c in out.calls] == [c.active_rows for c in eager.calls], name


def test_static_span_attention_rounds_differently_from_stock(checkpoint_125m):
    """attention="static" (the whole step capturable) reduces softmax and attn @ V over the full
    cache: prefill stays bit-identical, decode leaves stock's last bits (float32 here)."""
    model = CpuFirstModel(checkpoint_125m, dtype=torch.float32, device=torch.device("cpu"))
    model.use("resident")
    prompt = prompt_of(64, model.vocab)
    stock = run_episode(model, prompt, continuation=CONTINUATION, mode="eager")
    model.graph.attention = "static"
    out = run_episode(model, prompt, continuation=CONTINUATION, mode="graph")
    model.graph.attention = "live"
    assert out.tokens == stock.tokens
    assert np.array_equal(out.logits[0], stock.logits[0])
    diff = np.abs(out.logits[1:] - stock.logits[1:]).max()
    assert 0 < diff <= 1e-5 * np.abs(stock.logits).max()


def test_graph_refusal_names_the_reason():
    class P:
        name, gather = "packet", "host"

    assert graph_refusal(P(), torch.device("cpu")) == "no CUDA graphs on cpu"
    assert graph_refusal(P(), torch.device("cuda")) == "packet decides on the host"
    P.gather = "device"
    assert graph_refusal(P(), torch.device("cuda")) is None


def test_unknown_mode_is_refused(tiny):
    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    model.use("resident")
    with pytest.raises(ValueError, match="eager, graph"):
        run_episode(model, [2, 5, 6], continuation=2, mode="compiled")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attend_views_is_attend_bit_for_bit(device, dtype):
    """The replays' attention (3D views, the output written by the second bmm) against the eager
    calls' (torch.matmul, then a copy), at spans from one key to past a thousand."""
    from packbench.engine.static_opt import KVLayer, StaticOPT

    heads, head_dim, capacity = 32, 80, 1100  # opt-2.7b's heads
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dt).to(device)

    cache = KVLayer(rand(1, heads, capacity, head_dim), rand(1, heads, capacity, head_dim))
    decoder = StaticOPT.__new__(StaticOPT)  # attend reads no module state; only the sizes below
    decoder.heads, decoder.head_dim = heads, head_dim
    q = rand(1, 1, heads, head_dim).transpose(1, 2)  # pre's layout: a transposed view
    for span in (1, 2, 7, 64, 513, 527, 1024, 1100):
        want = torch.zeros((1, 1, heads * head_dim), dtype=dt, device=device)
        decoder.attend(q, cache, span, None, out=want)
        got = torch.zeros_like(want)
        StaticOPT.attend_views(decoder.attention_views(q, cache, got), span)
        assert torch.equal(got, want), span
        assert not torch.equal(got, torch.zeros_like(got))
    views = decoder.attention_views(q, cache, got)  # views, not copies: a replay refills q in place
    assert all(v.data_ptr() == t.data_ptr() for v, t in zip(views, (q, cache.keys, cache.values, got)))
