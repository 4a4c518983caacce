"""`llama-cpp` on a CUDA worker (llama-cpp-python built with CMAKE_ARGS=-DGGML_CUDA=on; the CPU twins
are tests/engine/test_llama_cpp.py): within fidelity of dense-stream with every layer's experts on
the device and with every layer's in host memory, the ledger's bytes by llama.cpp's rules, and a
placement over the allowance refused in one line.

The llama.cpp part runs in a child process (this file run as a script), a fresh process that has
imported torch before llama_cpp: where llama.cpp's load crashed on an H100 (libggml-cuda's exports of
the C++ runtime bound first; engine/llama_cpp.py cxx_runtime_global, docs/experiments/competitors.md),
and a crash must fail this test, not end the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.llamacpp,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPE = "qwen3-moe-tiny"
PROMPT = [list(range(7, 47))]  # 40 tokens: a prefill past llama.cpp's op-offload batch of 32
CONTINUATION = 6


def checks(ckpt: Path, cache: Path) -> dict:
    """Every figure the test asserts, computed in this (child) process."""
    import numpy as np

    from packbench.core.conditions.llama_cpp import layer_bytes
    from packbench.core.fidelity import fidelity
    from packbench.core.moe import moe_config
    from packbench.engine.episode import run_episode
    from packbench.engine.llama_cpp import LlamaCppModel, LlamaCppUnavailable
    from packbench.engine.moe.model import CpuFirstMoE

    def llama(n: int, allowance: int = 1 << 31) -> LlamaCppModel:
        return LlamaCppModel(ckpt, dtype=torch.float16, device=torch.device("cuda"), params={"n_cpu_moe": n, "op_offload": "on"},
                             allowance_bytes=allowance, context_bytes=0, capacity=64, batch=1, cache=cache)

    ref_model = CpuFirstMoE(ckpt, dtype=torch.float16, device=torch.device("cuda"))
    ref_model.use("dense-stream")
    ref = run_episode(ref_model, PROMPT, continuation=CONTINUATION)
    again = run_episode(ref_model, PROMPT, continuation=CONTINUATION)
    out = {"reference_reproduces": bool(np.array_equal(ref.logits, again.logits)), "runs": {}}
    del ref_model
    torch.cuda.empty_cache()
    layers = moe_config(SHAPE)["num_hidden_layers"]
    for n in (0, layers):
        model = llama(n)
        run = run_episode(model, PROMPT, continuation=CONTINUATION, forced=ref.tokens)
        f = fidelity(np.asarray(ref.logits[0]), run.logits[0], reference_tokens=ref.tokens[0], tokens=run.tokens[0])
        out["runs"][n] = {"top1": f.top1, "mean_kl": f.mean_kl, "gpu_layers": model.stats.gpu_layers,
                          "prefill_weights": run.calls[0].h2d_weight_bytes, "decode_weights": run.calls[1].h2d_weight_bytes,
                          "decode_d2h": run.calls[1].d2h_bytes}
        model.release()
    out["experts"] = layer_bytes(moe_config(SHAPE), dtype="float16")["experts"]
    try:
        llama(0, allowance=1 << 20)
        out["refused"] = None
    except LlamaCppUnavailable as e:
        out["refused"] = str(e)
    return out


def test_on_the_gpu_within_fidelity_with_the_ledger_by_llama_cpps_rules(tmp_path):
    pytest.importorskip("llama_cpp")  # a GPU machine without the [llamacpp] extra runs the other GPU tests
    from packbench.engine.moe.synth import synth_moe

    ckpt = synth_moe(tmp_path / SHAPE, shape=SHAPE, seed=3, dtype="float16")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, __file__, str(ckpt), str(tmp_path / "cache")], capture_output=True, text=True,
                       cwd=root, timeout=300)
    assert r.returncode == 0, f"the child exited {r.returncode} (negative: a signal): {r.stderr[-2000:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["reference_reproduces"]  # the reference reproduces itself first
    layers, experts = 3, got["experts"]
    for n, run in got["runs"].items():
        n = int(n)
        assert run["top1"] >= 0.8 and run["mean_kl"] < 1e-2, (n, run)
        assert run["gpu_layers"] == layers + 1
        # every host layer: its experts copied for the 40-token prefill (op offload), none at decode
        assert run["prefill_weights"] == [experts] * n + [0] * (layers - n)
        assert run["decode_weights"] == [0] * layers
        assert run["decode_d2h"] == [(64 + 2 * 4) * 4] * n + [0] * (layers - n)
    assert got["refused"] and ("MiB on the device" in got["refused"] or "over the allowance" in got["refused"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    print(json.dumps(checks(Path(sys.argv[1]), Path(sys.argv[2]))))
