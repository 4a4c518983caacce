"""CUDA twins of test_int8_packets.py: int8 packets bit-identical to the int8 dense-stream on a
real GPU, in mode eager and in mode graph (the int8 dense-stream and the int8 device packet
captured, the host packet run eagerly), with the same byte-exact ledgers.

`make test` deselects these (-m "not gpu"); run them on a GPU machine with `pytest -m gpu`.
"""

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.synth import synth_checkpoint

pytestmark = pytest.mark.gpu

PROMPT = [2] + list(range(10, 73))  # 64 tokens
CONTINUATION = 8
PACKETS8 = [("packet", {"gather": "host", "weights": "int8"}), ("packet", {"gather": "device", "weights": "int8"})]


@pytest.fixture(scope="module")
def checkpoint_125m(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "opt-125m", shape="opt-125m", dtype="float16",
                            sparsity=0.94, seed=0)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("which", ["tiny", "opt-125m"])
def test_cuda_int8_packets_bit_identical_to_the_int8_dense_stream(mode, dtype, which, checkpoints, checkpoint_125m):
    path = checkpoints["float32"] if which == "tiny" else checkpoint_125m
    model = CpuFirstModel(path, dtype=getattr(torch, dtype), device=torch.device("cuda"), mode=mode)
    model.use("dense-stream", weights="int8")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION)
    again = run_episode(model, PROMPT, continuation=CONTINUATION)
    assert np.array_equal(ref.logits, again.logits), "the int8 reference does not reproduce itself"
    if mode == "graph":
        assert again.decode_graph.startswith("captured"), again.decode_graph
    s = model.config
    row = s.hidden_size + 4
    assert all(c.h2d_weight_bytes == [s.ffn_dim * row] * s.num_hidden_layers for c in again.calls)
    for name, params in PACKETS8:
        model.use(name, **params)
        out = run_episode(model, PROMPT, continuation=CONTINUATION)
        assert np.array_equal(out.logits, ref.logits), (name, params)
        assert out.tokens == ref.tokens, (name, params)
        assert all(c.h2d_weight_bytes == [k * row for k in c.active_rows] for c in out.calls), params
        if mode == "graph":  # the host gather decides on the host; the device gather is one kernel a layer
            assert out.decode_graph.startswith("captured" if params["gather"] == "device" else "eager"), \
                (params, out.decode_graph)
