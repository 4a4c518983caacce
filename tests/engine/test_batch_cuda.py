"""CUDA twins of test_batch.py: a batch decodes bit for bit alike under every exact policy, in
mode eager and in mode graph, where the graph-safe policies replay a captured batch step and the
host-deciding ones run the same decoder eagerly (so a captured batch must attend as eager
decode does). Every claim first checks that dense-stream reproduces itself."""

import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from tests.engine.test_batch import VARIANTS, prompts_of

pytestmark = pytest.mark.gpu

CONTINUATION = 6
GRAPH_SAFE = ("resident", "dense-stream", "packet+gather=device", "early-forecast+gather=device",
              "phase-switched+gather=device")


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("batch", [2, 4])
def test_cuda_batches_are_bit_identical_to_dense_stream(mode, batch, checkpoints):
    model = CpuFirstModel(checkpoints["float32"], dtype=torch.float16, device=torch.device("cuda"), mode=mode)
    prompts = prompts_of(batch, model.vocab)
    refs = {}
    for weights in ("dtype", "int8"):
        model.use("dense-stream", weights=weights)
        ref, again = (run_episode(model, prompts, continuation=CONTINUATION) for _ in range(2))
        assert ref.logits.tobytes() == again.logits.tobytes(), f"dense-stream {weights} does not reproduce itself"
        refs[weights] = ref
    for key, (name, params) in VARIANTS.items():
        model.use(name, **params)
        out = run_episode(model, prompts, continuation=CONTINUATION)
        ref = refs[params.get("weights", "dtype")]
        assert out.logits.shape == (batch, CONTINUATION, model.vocab)
        assert out.logits.tobytes() == ref.logits.tobytes(), (key, mode, batch)
        assert out.tokens == ref.tokens, (key, mode, batch)
        if mode == "graph" and key in GRAPH_SAFE:
            assert out.decode_graph.startswith("captured"), (key, out.decode_graph)
