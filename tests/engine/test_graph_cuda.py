"""CUDA twins of test_static_opt.py: mode "graph" with the decode step captured and replayed.

Run on a GPU machine with `pytest -m gpu`. The reference (dense-stream, mode graph) first
reproduces itself; graph-safe policies are captured, the others run the same decoder eagerly,
so "captured == eager on the same ops" is checked by every cross-policy comparison.
"""

import re

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.synth import synth_checkpoint

pytestmark = pytest.mark.gpu

PROMPT = [2] + list(range(10, 73))  # 64 tokens
CONTINUATION = 8
CAPTURED = [("resident", {}), ("dense-stream", {}), ("packet", {"gather": "device"}),
            ("early-forecast", {"gather": "device"}), ("phase-switched", {"gather": "device"})]
EAGER = [("packet", {}), ("sparse-extents", {}), ("row-retention", {"rows_per_layer": 64}), ("early-forecast", {}),
         ("phase-switched", {})]


@pytest.fixture(scope="module")
def checkpoint_125m(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "opt-125m", shape="opt-125m", dtype="float16",
                            sparsity=0.94, seed=0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("which", ["tiny", "opt-125m"])
def test_cuda_graph_mode_bit_identical_within_the_mode(dtype, which, checkpoints, checkpoint_125m):
    path = checkpoints["float32"] if which == "tiny" else checkpoint_125m
    model = CpuFirstModel(path, dtype=getattr(torch, dtype), device=torch.device("cuda"))
    model.use("dense-stream")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
    model.use("dense-stream")
    again = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
    assert np.array_equal(ref.logits, again.logits), "the reference does not reproduce itself"
    # The first episode of a policy class warms up eagerly; the second captures at once and
    # replays its first decode call: the same bits either way.
    assert ref.decode_graph.startswith("captured") and ref.decode_graph.endswith("after an eager warm-up call)")
    assert again.decode_graph.startswith("captured") and "warm-up" not in again.decode_graph
    total, ending = (float(x) for x in re.fullmatch(r"captured \((\d+\.\d) ms, (\d+\.\d) of them instantiating\)",
                                                    again.decode_graph).groups())
    assert 0 <= ending <= total
    for name, params in CAPTURED + EAGER:
        model.use(name, **params)
        out = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
        assert out.decode_graph.startswith("captured") == ((name, params) in CAPTURED), (name, out.decode_graph)
        assert np.array_equal(out.logits, ref.logits), (name, params)
        assert out.tokens == ref.tokens, (name, params)
    # Against stock transformers (mode eager): attention over the live keys runs stock's
    # kernels, the rest is the same ops captured: every call's logits bit-identical.
    model.use("dense-stream")
    stock = run_episode(model, PROMPT, continuation=CONTINUATION, mode="eager")
    assert stock.tokens == ref.tokens
    assert np.array_equal(stock.logits, ref.logits)
    s = model.config
    weight_bytes = s.hidden_size * s.ffn_dim * getattr(torch, dtype).itemsize
    assert sum(sum(c.h2d_weight_bytes) for c in ref.calls) == CONTINUATION * s.num_hidden_layers * weight_bytes


def test_cuda_graph_ledger_equals_eager_ledger(tiny):
    """The tape replays what the policy's host side adds; the device gather's counts settle
    after each replay: the captured ledger equals the host gather's, which runs eagerly."""
    model = CpuFirstModel(tiny, dtype=torch.float16, device=torch.device("cuda"))
    model.use("packet")
    host = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
    assert host.decode_graph.startswith("eager")
    for warm_up in (True, False):  # the first device episode warms up eagerly, the second does not
        model.use("packet", gather="device")
        device = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
        assert device.decode_graph.startswith("captured")
        assert ("warm-up" in device.decode_graph) == warm_up, device.decode_graph
        assert [c.active_rows for c in device.calls] == [c.active_rows for c in host.calls]
        assert [c.h2d_weight_bytes for c in device.calls] == [c.h2d_weight_bytes for c in host.calls]
        assert [c.phase for c in device.calls] == ["prefill"] + ["decode"] * (CONTINUATION - 1)
        assert all(sum(c.d2h_bytes) == 4 * model.recorder.layers for c in device.calls)
        assert np.array_equal(device.logits, host.logits)
    # early-forecast: the device's captured forecasts move the host's rows, bytes and waste, call
    # by call and layer by layer
    model.use("early-forecast")
    host = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
    assert host.decode_graph.startswith("eager") and sum(sum(c.rows_wasted) for c in host.calls) > 0
    for warm_up in (True, False):
        model.use("early-forecast", gather="device")
        device = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
        assert device.decode_graph.startswith("captured") and ("warm-up" in device.decode_graph) == warm_up
        for key in ("active_rows", "rows_copied", "h2d_weight_bytes", "rows_wasted"):
            assert [getattr(c, key) for c in device.calls] == [getattr(c, key) for c in host.calls], key
        assert np.array_equal(device.logits, host.logits)


def test_cuda_graph_replays_follow_new_tokens(tiny):
    """A replay must write the KV slot and read the position it is given (the stock probe's
    failure): two prompts through one model give each its own tokens, equal to mode eager's."""
    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cuda"))
    for prompt in (PROMPT, [2] + list(range(100, 140))):
        model.use("resident")
        graph = run_episode(model, prompt, continuation=12, mode="graph")
        eager = run_episode(model, prompt, continuation=12, mode="eager")
        assert graph.tokens == eager.tokens
        assert np.abs(graph.logits - eager.logits).max() <= 1e-4 * np.abs(eager.logits).max()


def test_cuda_static_span_graph_is_exact_within_itself(tiny):
    """attention="static": one graph per step over the full span; every captured policy equals
    dense-stream in the same variant, and the tokens equal stock's on this prompt."""
    model = CpuFirstModel(tiny, dtype=torch.float16, device=torch.device("cuda"))
    model.graph.attention = "static"
    outs = {}
    for name, params in CAPTURED + [("packet", {})]:
        model.use(name, **params)
        outs[name, str(params)] = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
    model.graph.attention = "live"
    ref = outs["dense-stream", "{}"]
    assert ref.decode_graph.startswith("captured")
    for key, out in outs.items():
        assert np.array_equal(out.logits, ref.logits), key
    model.use("dense-stream")
    assert run_episode(model, PROMPT, continuation=CONTINUATION, mode="eager").tokens == ref.tokens


def test_cuda_models_share_the_capture_streams(tiny):
    """Each stream used for cuBLAS keeps a workspace for the process's life: a model loaded after
    another captures on the same side and branch streams, so cold loads do not add workspaces."""
    streams = []
    for _ in range(2):
        model = CpuFirstModel(tiny, dtype=torch.float16, device=torch.device("cuda"))
        model.use("resident")
        out = run_episode(model, PROMPT, continuation=CONTINUATION, mode="graph")
        assert out.decode_graph.startswith("captured")
        streams.append(model.graph.streams())
        del model
    assert streams[0][0] is streams[1][0] and streams[0][1] is streams[1][1]
