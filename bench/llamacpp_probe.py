"""llama.cpp's teacher-forced logits beside packbench's dense-stream, with experts kept in host memory
by tensor buffer overrides: the two pieces a `llama-cpp` condition kind needs, tried alone.

  python -m bench.llamacpp_probe --model DIR --gguf FILE [--n-cpu-moe N] [--device cpu|cuda]

DIR is a packbench MoE checkpoint and FILE its GGUF conversion (`python -m bench.llamacpp_gguf`).
The probe runs packbench's `dense-stream` on DIR (the reference: greedy tokens and every call's
logits), then llama.cpp (llama-cpp-python) on FILE, fed the prompt and the reference's tokens
(teacher-forced), and prints how far its logits are from the reference's with the fidelity gate's own figures
(core/fidelity.py): max |difference|, mean and p99 KL(reference || llama.cpp), top-1 agreement.

Experts in host memory: llama-cpp-python 0.3.36's `Llama` passes no tensor buffer overrides (what
llama.cpp's `--n-cpu-moe N` sets), so the probe fills `tensor_buft_overrides` itself with the
`llama-cpp` condition's helpers (engine/llama_cpp.py `expert_overrides`, `host_buffer_type`) and
loads the model through the low-level API (`llama_model_load_from_file`; the context, batch and
logits too). The condition itself (packbench's own GGUF conversion, the placement, whole episodes)
superseded this probe; it stays as the one-decode check of a GGUF made by llama.cpp's converter.

Needs llama-cpp-python (built with CUDA for a GPU run: `CMAKE_ARGS=-DGGML_CUDA=on`), numpy, torch
and packbench. On the CPU (llama-cpp-python 0.3.36 from its sdist, 361 s to build on 2 cores),
qwen3-moe-tiny in float32, 24 + 5 tokens: mean KL 1.6e-05, max |d| 0.050, top-1 4 of 5 teacher-forced
steps, the same with the experts of both layers overridden to host memory (a CPU build: no move).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np


def llama_logits(gguf: Path, tokens: list[int], *, n_cpu_moe: int, gpu_layers: int, threads: int) -> np.ndarray:
    """(len(tokens), vocab) float32 logits of every position, one decode of the whole sequence."""
    from packbench.engine.llama_cpp import backend, expert_overrides, host_buffer_type, library

    lc = library()
    backend(lc)  # once: llama.cpp's load and context lines dropped
    params = lc.llama_model_default_params()
    params.n_gpu_layers = gpu_layers
    overrides = expert_overrides(n_cpu_moe, host_buffer_type(lc)) if n_cpu_moe else None
    if overrides is not None:
        params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    model = lc.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = max(len(tokens), 16)
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    try:
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        batch = lc.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            batch.n_tokens = len(tokens)
            if lc.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            return np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,)).copy()
                             for i in range(len(tokens))])
        finally:
            lc.llama_batch_free(batch)
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the packbench MoE checkpoint (the reference's)")
    ap.add_argument("--gguf", type=Path, required=True, help="its GGUF conversion (bench.llamacpp_gguf)")
    ap.add_argument("--prefix", type=int, default=24)
    ap.add_argument("--continuation", type=int, default=8)
    ap.add_argument("--n-cpu-moe", type=int, default=0, help="layers whose experts stay in host memory")
    ap.add_argument("--gpu-layers", type=int, default=0, help="llama.cpp's n_gpu_layers (99: every layer)")
    ap.add_argument("--device", default="cpu", help="the reference's device")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="the reference's dtype (the GGUF's: --outtype f32 or f16)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    import torch

    from packbench.core.fidelity import fidelity
    from packbench.engine.episode import run_episode
    from packbench.engine.moe.model import CpuFirstMoE

    ref_model = CpuFirstMoE(a.model, dtype=getattr(torch, a.dtype), device=torch.device(a.device))
    ref_model.use("dense-stream")
    prompt = list(range(7, 7 + a.prefix))
    ref = run_episode(ref_model, prompt, continuation=a.continuation)
    tokens = [int(t) for t in np.asarray(ref.tokens).reshape(-1)]
    want = np.asarray(ref.logits, dtype=np.float32).reshape(len(tokens), -1)
    every = llama_logits(a.gguf, prompt + tokens[:-1], n_cpu_moe=a.n_cpu_moe, gpu_layers=a.gpu_layers,
                         threads=a.threads)
    got = every[len(prompt) - 1:]  # the prompt's last position, then each teacher-forced token's
    f = fidelity(want, got, reference_tokens=tokens, tokens=tokens)  # the gate's figures; its own tokens unknown
    print(f"llama.cpp teacher-forced against dense-stream ({a.model.name}, {len(tokens)} calls, experts of "
          f"{a.n_cpu_moe} layers in host memory, n_gpu_layers {a.gpu_layers}): max |d| {f.max_abs_logit:.4g}, "
          f"mean KL {f.mean_kl:.3g}, p99 KL {f.p99_kl:.3g}, top-1 {f.top1:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
