"""Mode "graph" on the CPU (the twin of test_graph_cuda.py): packbench's static decoder against
stock transformers, and every policy against dense-stream within the mode."""

import numpy as np
import pytest
import torch

from engine.episode import run_episode
from engine.graph import graph_refusal
from engine.model import CpuFirstModel
from engine.policies import POLICIES
from engine.static_opt import StaticOPT

CONTINUATION = 5
PARAMS = {"sparse-extents": {"block_rows": 16}, "row-retention": {"rows_per_layer": 48}}
LEDGER_CHECKED = ("dense-stream", "packet", "packet+gather=device", "row-retention")  # the CPU has 2 cores
VARIANTS = {**{name: (name, PARAMS.get(name, {})) for name in POLICIES},
            "packet+gather=device": ("packet", {"gather": "device"})}


def prompt_of(length: int, vocab: int) -> list[int]:
    return [2] + [(7 * i + 11) % (vocab - 4) + 4 for i in range(length - 1)]


@pytest.fixture(scope="module")
def checkpoint_125m(tmp_path_factory):
    from engine.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "opt-125m", shape="opt-125m", dtype="float32",
                            sparsity=0.94, seed=0)


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


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_opt125m_graph_mode_tokens_equal_stock_and_policies_equal_dense_stream(dtype, checkpoint_125m):
    """Tokens equal stock always; prefill logits are bit-identical; decode logits are within
    rounding of stock (full-span attention, see engine/static_opt.py) and bit-identical across
    every policy within the mode."""
    model = CpuFirstModel(checkpoint_125m, dtype=getattr(torch, dtype), device=torch.device("cpu"))
    prompt = prompt_of(64, model.vocab)
    model.use("dense-stream")
    stock = run_episode(model, prompt, continuation=CONTINUATION, mode="eager")
    ref = run_episode(model, prompt, continuation=CONTINUATION, mode="graph")
    assert run_episode(model, prompt, continuation=CONTINUATION, mode="graph").logits.tobytes() == ref.logits.tobytes()
    assert ref.tokens == stock.tokens
    assert np.array_equal(ref.logits[0], stock.logits[0])  # prefill: the same shapes, the same bits
    scale = np.abs(stock.logits).max()
    tolerance = (1e-5 if dtype == "float32" else 2e-2) * scale
    assert np.abs(ref.logits - stock.logits).max() <= tolerance
    for name, (policy, params) in VARIANTS.items():
        model.use(policy, **params)
        out = run_episode(model, prompt, continuation=CONTINUATION, mode="graph")
        assert np.array_equal(out.logits, ref.logits), name
        if name not in LEDGER_CHECKED:
            continue
        model.use(policy, **params)  # fresh: an LRU cache must not carry over
        eager = run_episode(model, prompt, continuation=CONTINUATION, mode="eager")
        assert [c.h2d_weight_bytes for c in out.calls] == [c.h2d_weight_bytes for c in eager.calls], name
        assert [c.active_rows for c in out.calls] == [c.active_rows for c in eager.calls], name


def test_decode_over_the_live_span_is_bit_identical_to_stock(checkpoint_125m):
    """Why decode logits may leave stock's last bits: attending over exactly the live keys (the
    shapes stock uses) gives stock's bits; only the static span changes the reduction."""
    model = CpuFirstModel(checkpoint_125m, dtype=torch.float32, device=torch.device("cpu"))
    model.use("resident")
    prompt = prompt_of(16, model.vocab)
    stock = run_episode(model, prompt, continuation=CONTINUATION, mode="eager")
    st = StaticOPT(model.model, model.slot)
    kv = st.new_cache(len(prompt) + CONTINUATION)
    with torch.inference_mode():
        rows = [st.prefill(torch.tensor([prompt]), kv).numpy()]
        for c in range(CONTINUATION - 1):
            n = len(prompt) + c
            pos = torch.tensor([n])
            ids = torch.tensor([[stock.tokens[c]]])
            rows.append(st._forward(ids, pos, st._mask(pos, n + 1), kv, span=n + 1).numpy())
    assert np.array_equal(np.stack(rows), stock.logits)


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
