"""dense-stream's copy stream on a real GPU (CUDA twin of test_dense_stream.py).

Run on a GPU machine with `pytest -m gpu`. A missing wait shows as a wrong weight: the policy
is driven directly with a compute stream made slow on purpose, and whole models are compared
with resident (no copies at all) in mode eager, mode graph and the whole-step graph.
"""

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.ledger import Recorder
from packbench.engine.model import CpuFirstModel
from packbench.engine.policies.base import HostWeights
from packbench.engine.policies.dense import DenseStream
from packbench.engine.synth import synth_checkpoint

pytestmark = pytest.mark.gpu

PROMPT = [2] + list(range(10, 73))  # 64 tokens
CONTINUATION = 8
HIDDEN, FFN, LAYERS = 2048, 8192, 6  # 32 MiB a layer in fp16: a copy takes ~0.6 ms


def test_cuda_copies_land_before_fc2_and_never_overwrite_a_workspace_in_use():
    """Layer l's weight is all l + 1. Right after fetch the compute stream reads the workspace
    (a missing wait on the copy reads the layer before); then it sleeps ~2 ms and reads it
    again (a copy two layers ahead that did not wait for this read would have replaced it)."""
    host = HostWeights([torch.full((HIDDEN, FFN), float(l + 1), dtype=torch.float16) for l in range(LAYERS)],
                       pin=True)
    recorder = Recorder(LAYERS)
    policy = DenseStream()
    policy.activate(host, torch.device("cuda"), recorder)
    assert policy.buffers.copy is not None
    h = torch.zeros(1, FFN, dtype=torch.float16, device="cuda")
    seen = torch.zeros(3, LAYERS, 4, dtype=torch.float16, device="cuda")  # min, max; min, max later
    for call in range(3):
        recorder.begin(phase="decode", tokens=1)
        for layer in range(LAYERS):
            policy.before_layer(layer)
            weight = policy.fetch(layer, h)
            seen[call, layer, :2] = torch.stack([weight.amin(), weight.amax()])
            torch.cuda._sleep(4_000_000)  # ~2 ms of a busy compute stream
            seen[call, layer, 2:] = torch.stack([weight.amin(), weight.amax()])
        recorder.end(wall_s=0.0, logits_d2h_bytes=0)
    torch.cuda.synchronize()
    expected = torch.arange(1, LAYERS + 1, dtype=torch.float16)[None, :, None].expand(3, LAYERS, 4)
    assert torch.equal(seen.cpu(), expected)
    for call in recorder.calls:
        assert call.h2d_weight_bytes == [HIDDEN * FFN * 2] * LAYERS and call.rows_copied == [FFN] * LAYERS
    policy.deactivate()


@pytest.fixture(scope="module")
def checkpoint_125m(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "opt-125m", shape="opt-125m", dtype="float16",
                            sparsity=0.94, seed=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_double_buffered_dense_stream_equals_resident_in_every_mode(dtype, checkpoint_125m):
    model = CpuFirstModel(checkpoint_125m, dtype=getattr(torch, dtype), device=torch.device("cuda"))
    s = model.config
    weight_bytes = s.hidden_size * s.ffn_dim * getattr(torch, dtype).itemsize
    for mode, attention in (("eager", "live"), ("graph", "live"), ("graph", "static")):
        model.graph.attention = attention
        model.use("resident")
        ref = run_episode(model, PROMPT, continuation=CONTINUATION, mode=mode)
        again = run_episode(model, PROMPT, continuation=CONTINUATION, mode=mode)
        assert np.array_equal(ref.logits, again.logits), f"resident does not reproduce itself ({mode}, {attention})"
        model.use("dense-stream")
        assert model.slot.policy.buffers.copy is not None
        out = run_episode(model, PROMPT, continuation=CONTINUATION, mode=mode)
        if mode == "graph":
            assert out.decode_graph.startswith("captured"), out.decode_graph
        assert np.array_equal(out.logits, ref.logits), (mode, attention)
        assert out.tokens == ref.tokens, (mode, attention)
        # The ledger of one copy per layer at fetch: every call, every layer, the whole weight,
        # replayed calls included.
        assert [c.rows_copied for c in out.calls] == [[s.ffn_dim] * s.num_hidden_layers] * CONTINUATION
        assert [c.h2d_weight_bytes for c in out.calls] == [[weight_bytes] * s.num_hidden_layers] * CONTINUATION
        assert all(sum(c.h2d_index_bytes) == sum(c.d2h_bytes) == 0 for c in out.calls)
    model.graph.attention = "live"
