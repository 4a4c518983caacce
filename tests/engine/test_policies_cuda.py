"""CUDA twins of test_policies.py: the same exactness and ledger claims on a real GPU.

`make test` deselects these (-m "not gpu"); run them on a GPU machine with `pytest -m gpu`.
Every exactness claim first checks that the reference reproduces itself run to run.
"""

import numpy as np
import pytest
import torch

from packbench.engine.episode import run_episode
from packbench.engine.model import CpuFirstModel
from packbench.engine.conditions import POLICIES
from packbench.core.registry import SHAPES
from packbench.engine.synth import synth_checkpoint

pytestmark = pytest.mark.gpu

PROMPT = [2] + list(range(10, 73))  # 64 tokens
CONTINUATION = 8
PARAMS = {"row-retention": {"rows_per_layer": 1024}}


@pytest.fixture(scope="module")
def checkpoint_125m(tmp_path_factory):
    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "opt-125m", shape="opt-125m", dtype="float16",
                            sparsity=0.94, seed=0)


@pytest.fixture(scope="module")
def checkpoint_profile(tmp_path_factory):
    """The calibrated profile (docs/workloads.md): heavy-tailed rates, peaked logits, as the CPU twin has."""
    return synth_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-opt", shape="tiny", dtype="float32", seed=0,
                            profile="opt")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("which", ["tiny", "opt-125m", "tiny-profile-opt"])
def test_cuda_policies_bit_identical(dtype, which, checkpoints, checkpoint_125m, checkpoint_profile):
    path = {"tiny": checkpoints["float32"], "opt-125m": checkpoint_125m, "tiny-profile-opt": checkpoint_profile}[which]
    model = CpuFirstModel(path, dtype=getattr(torch, dtype), device=torch.device("cuda"))
    model.use("dense-stream")
    ref = run_episode(model, PROMPT, continuation=CONTINUATION)
    again = run_episode(model, PROMPT, continuation=CONTINUATION)
    assert np.array_equal(ref.logits, again.logits), "the reference does not reproduce itself"
    # Registry defaults; row-retention has none (a protocol must state it): 1024 rows a layer.
    # Every gather=device variant the CPU twin runs (tests/engine/test_policies.py VARIANTS).
    variants = [(name, PARAMS.get(name, {})) for name in POLICIES] + [("packet", {"gather": "device"}),
                                                                       ("early-forecast", {"gather": "device"}),
                                                                       ("phase-switched", {"gather": "device"})]
    for name, params in variants:
        model.use(name, **params)
        out = run_episode(model, PROMPT, continuation=CONTINUATION)
        assert np.array_equal(out.logits, ref.logits), (name, params)
        assert out.tokens == ref.tokens, (name, params)
    # Tokens equal stock transformers' greedy generate on the same checkpoint, on the GPU.
    from packbench.engine.checkpoint import build_model

    stock = build_model(path, dtype=getattr(torch, dtype)).to("cuda")
    ids = stock.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=CONTINUATION,
                         min_new_tokens=CONTINUATION, do_sample=False)
    assert ids[0, len(PROMPT):].tolist() == ref.tokens
    del stock
    s = model.config
    weight_bytes = s.hidden_size * s.ffn_dim * getattr(torch, dtype).itemsize
    assert sum(sum(c.h2d_weight_bytes) for c in ref.calls) == CONTINUATION * s.num_hidden_layers * weight_bytes


def test_cuda_outgoing_weights_stay_on_the_host(tiny):
    model = CpuFirstModel(tiny, dtype=torch.float16, device=torch.device("cuda"))
    assert all(w.device.type == "cpu" and w.is_pinned() for w in model.host.original)
    assert all(p.device.type == "cuda" for p in model.model.parameters())
    hidden, ffn, layers = (SHAPES["tiny"][k] for k in ("hidden", "ffn", "layers"))
    assert model.start.host_outgoing_bytes == layers * hidden * ffn * 2


def test_cuda_device_gather_ledger_matches_host_gather(tiny):
    model = CpuFirstModel(tiny, dtype=torch.float16, device=torch.device("cuda"))
    model.use("packet")
    host = run_episode(model, PROMPT, continuation=CONTINUATION)
    model.use("packet", gather="device")
    device = run_episode(model, PROMPT, continuation=CONTINUATION)
    assert [c.active_rows for c in device.calls] == [c.active_rows for c in host.calls]
    assert [c.h2d_weight_bytes for c in device.calls] == [c.h2d_weight_bytes for c in host.calls]
    assert all(sum(c.h2d_index_bytes) == 0 for c in device.calls)  # the indices never leave the GPU


def test_cuda_sampler_process_sees_an_allocation():
    from packbench.engine.sampler import MemorySampler, device_uuid

    uuid = device_uuid(0)
    assert uuid is not None, "NVML must see the GPU"
    sampler = MemorySampler(uuid, period_s=0.002)
    sampler.start()
    before = sampler.stop()
    sampler.start()
    block = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    import time

    time.sleep(0.05)
    after = sampler.stop()
    del block
    assert after["peak_sampled_bytes"] >= before["peak_sampled_bytes"] + (512 << 20)
    assert after["trace"].shape[1] == 2 and after["samples"] >= 5 and after["scope"] == "process"
    assert after["trace"][:, 1].max() == after["peak_sampled_bytes"]
    sampler.close()
