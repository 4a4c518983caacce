"""llama.cpp's teacher-forced logits beside packbench's dense-stream, with experts kept in host memory
by tensor buffer overrides: the two pieces a `llama-cpp` condition kind needs, tried alone.

  python -m bench.llamacpp_probe --model DIR --gguf FILE [--n-cpu-moe N] [--device cpu|cuda]

DIR is a packbench MoE checkpoint and FILE its GGUF conversion (`python -m bench.llamacpp_gguf`).
The probe runs packbench's `dense-stream` on DIR (the reference: greedy tokens and every call's
logits), then llama.cpp (llama-cpp-python) on FILE, fed the prompt and the reference's tokens
(teacher-forced), and prints how far its logits are from the reference's with the fidelity gate's own figures
(core/fidelity.py): max |difference|, mean and p99 KL(reference || llama.cpp), top-1 agreement.

Experts in host memory: llama-cpp-python 0.3.36's `Llama` passes no tensor buffer overrides (what
llama.cpp's `--n-cpu-moe N` sets), and its `llama_model_params` declares `tensor_buft_overrides`
as an unused pointer; the probe fills that field itself, a NULL-terminated array of {pattern,
buffer type} with the host's buffer type (`ggml_backend_dev_buffer_type` of the CPU device), for
the expert tensors of the first N layers, as llama.cpp's own option does, and loads the model
through the low-level API (`llama_model_load_from_file`; the context, batch and logits too).

Needs llama-cpp-python (built with CUDA for a GPU run: `CMAKE_ARGS=-DGGML_CUDA=on`), numpy, torch
and packbench. On the CPU (llama-cpp-python 0.3.36 from its sdist, 361 s to build on 2 cores),
qwen3-moe-tiny in float32, 24 + 5 tokens: mean KL 1.6e-05, max |d| 0.050, top-1 4 of 5 teacher-forced
steps, the same with the experts of both layers overridden to host memory (a CPU build: no move).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys
from pathlib import Path

import numpy as np

# llama.cpp's `--n-cpu-moe` patterns: the routed experts' tensors of one layer (common/arg.cpp).
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
CPU_DEVICE_TYPE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU


class BuftOverride(ctypes.Structure):
    """llama.h `struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def host_buffer_type(llama_cpp) -> int:
    """The CPU device's buffer type (ggml-backend.h), from the libraries llama-cpp-python ships."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    ggml, base = ctypes.CDLL(str(lib / "libggml.so")), ctypes.CDLL(str(lib / "libggml-base.so"))
    ggml.ggml_backend_dev_by_type.restype, ggml.ggml_backend_dev_by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    device = ggml.ggml_backend_dev_by_type(CPU_DEVICE_TYPE)
    if not device:
        raise SystemExit("llama.cpp found no CPU device to keep the experts on")
    return base.ggml_backend_dev_buffer_type(device)


def expert_overrides(layers: int, buft: int) -> ctypes.Array:
    """{pattern, buft} for the experts of layers 0..layers-1, NULL-terminated (kept alive by the caller)."""
    rows = [BuftOverride(rf"blk\.{i}{EXPERT_TENSORS}".encode(), buft) for i in range(layers)]
    return (BuftOverride * (len(rows) + 1))(*rows, BuftOverride(None, None))


@functools.cache
def quiet_log():
    """A log callback that drops llama.cpp's lines, made once and kept alive (llama.cpp calls it later)."""
    import llama_cpp as lc

    return lc.llama_log_callback(lambda level, text, user_data: None)


def llama_logits(gguf: Path, tokens: list[int], *, n_cpu_moe: int, gpu_layers: int, threads: int) -> np.ndarray:
    """(len(tokens), vocab) float32 logits of every position, one decode of the whole sequence."""
    import llama_cpp as lc

    lc.llama_log_set(quiet_log(), ctypes.c_void_p(0))  # llama.cpp's load and context lines
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
