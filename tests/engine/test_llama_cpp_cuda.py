"""`llama-cpp` on a CUDA worker (llama-cpp-python built with CMAKE_ARGS=-DGGML_CUDA=on; the CPU twins
are tests/engine/test_llama_cpp.py): within fidelity of dense-stream with every layer's experts on
the device and with every layer's in host memory, the ledger's bytes by llama.cpp's rules, and a placement over the allowance
refused in one line."""

import numpy as np
import pytest
import torch

from packbench.core.conditions.llama_cpp import layer_bytes
from packbench.core.fidelity import fidelity
from packbench.core.moe import moe_config
from packbench.engine.episode import run_episode
from packbench.engine.moe.model import CpuFirstMoE
from packbench.engine.moe.synth import synth_moe

pytestmark = [pytest.mark.gpu, pytest.mark.llamacpp,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPE = "qwen3-moe-tiny"
PROMPT = [list(range(7, 47))]  # 40 tokens: a prefill past llama.cpp's op-offload batch of 32
CONTINUATION = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synth_moe(tmp_path_factory.mktemp("llama-cpp-cuda") / SHAPE, shape=SHAPE, seed=3, dtype="float16")


def _llama(path, cache, n_cpu_moe, allowance=1 << 30):
    from packbench.engine.llama_cpp import LlamaCppModel

    return LlamaCppModel(path, dtype=torch.float16, device=torch.device("cuda"), params={"n_cpu_moe": n_cpu_moe},
                         allowance_bytes=allowance, context_bytes=0, capacity=64, batch=1, cache=cache)


def test_on_the_gpu_within_fidelity_and_the_host_experts_off_the_device(ckpt, tmp_path):
    ref_model = CpuFirstMoE(ckpt, dtype=torch.float16, device=torch.device("cuda"))
    ref_model.use("dense-stream")
    ref = run_episode(ref_model, PROMPT, continuation=CONTINUATION)
    again = run_episode(ref_model, PROMPT, continuation=CONTINUATION)
    assert np.array_equal(ref.logits, again.logits)  # the reference reproduces itself first
    del ref_model
    torch.cuda.empty_cache()
    layers = moe_config(SHAPE)["num_hidden_layers"]
    experts = layer_bytes(moe_config(SHAPE), dtype="float16")["experts"]
    for n in (0, layers):
        model = _llama(ckpt, tmp_path, n)
        assert model.stats.gpu_layers == layers + 1
        out = run_episode(model, PROMPT, continuation=CONTINUATION, forced=ref.tokens)
        f = fidelity(np.asarray(ref.logits[0]), out.logits[0], reference_tokens=ref.tokens[0], tokens=out.tokens[0])
        assert f.top1 >= 0.8 and f.mean_kl < 1e-2, (n, f)
        prefill, decode = out.calls[0], out.calls[1]
        # every host layer: its experts copied for the 40-token prefill (op offload), none at decode
        assert prefill.h2d_weight_bytes == [experts] * n + [0] * (layers - n)
        assert decode.h2d_weight_bytes == [0] * layers
        assert decode.d2h_bytes == [(64 + 2 * 4) * 4] * n + [0] * (layers - n)
        model.release()


def test_a_placement_over_the_allowance_is_refused(ckpt, tmp_path):
    from packbench.engine.llama_cpp import LlamaCppUnavailable

    with pytest.raises(LlamaCppUnavailable, match="needs .* MiB on the device|over the allowance"):
        _llama(ckpt, tmp_path, 0, allowance=1 << 20)
