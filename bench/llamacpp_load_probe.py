"""Which llama.cpp loads crash on a CUDA machine, one variant a process (bench/llamacpp_screen_device.sh
ONLY=probe). VARIANT is SHAPE:LAYERS:N[:HOW]: a synthetic checkpoint of that shape and depth (fp16, drawn
on the GPU), its GGUF (engine/llama_cpp.py) loaded through llama.cpp's C API every layer on the GPU, the
experts of the first N layers overridden to host memory, HOW one of `null` (no override array at all:
the field left NULL; the default where N is 0), `array` (an array even for N 0: only its NULL end),
`registry` (the CPU device's buffer type looked up before the load), `nommap`, `ray` (the same load
inside a Ray actor holding the GPU, as packbench's worker runs it), `first` (llama_cpp imported before
torch and everything else, libstdc++ made global first as engine/llama_cpp.py library() does), `bare`
(llama_cpp imported first, as is), `local` (without library()'s promotion of libstdc++); then a
context and one decode of 40 tokens. Prints the C++ runtime and OpenMP libraries the process has
mapped before the load, then `ok` with the argmax, else the process dies and the caller says how
(with bench/segv_trace.c preloaded: the native frames).

  PACKBENCH_LLAMA_LOG=1 python -m bench.llamacpp_load_probe VARIANT WORKDIR
"""

import sys

if sys.argv[1].endswith(":first"):  # before torch, numpy and ray, the runtime global first as library() does
    import ctypes as _ctypes

    _ctypes.CDLL("libstdc++.so.6", mode=_ctypes.RTLD_GLOBAL)
    import llama_cpp as _first  # noqa: F401
elif sys.argv[1].endswith(":bare"):  # before anything, as llama-cpp-python's users import it (no promotion)
    import llama_cpp as _first  # noqa: F401

import ctypes
from pathlib import Path

import numpy as np

from packbench.engine import llama_cpp
from packbench.engine.moe.synth import synth_moe


def runtime_libraries() -> list[str]:
    """The C++ runtime, OpenMP and CUDA runtime libraries mapped into this process."""
    names = ("libstdc++", "libgomp", "libcudart", "libcublas.so", "libggml", "libllama")
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if any(n in line for n in names)}
    return sorted(paths)


def main() -> None:
    variant, work = sys.argv[1], Path(sys.argv[2])
    if variant.endswith(":ray"):
        import ray

        ray.init(num_gpus=1, include_dashboard=False)
        actor = ray.remote(num_gpus=1)(Loader).remote()
        try:
            print(ray.get(actor.load.remote(variant, str(work))), flush=True)
        except Exception as e:  # the worker died: say how, in one line
            print(f"{variant}: the Ray worker failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        return
    load(variant, work)


class Loader:
    """The load in a Ray actor's process, as packbench's worker runs llama.cpp."""

    def load(self, variant: str, work: str) -> str:
        return load(variant, Path(work))


def load(variant: str, work: Path) -> str:
    shape, layers, n, *how = variant.split(":")
    n, how = int(n), (how or ["null"])[0]
    d = work / f"{shape}-{layers}"
    if not (d / "config.json").exists():
        import torch

        synth_moe(d, shape=shape, seed=3, dtype="float16", layers=int(layers),
                  device="cuda" if torch.cuda.is_available() else "cpu")
    gguf = llama_cpp.converted(d, work / "mc", dtype="float16")
    if how == "local":
        llama_cpp.cxx_runtime_global = lambda: None
    lc = llama_cpp.library()
    llama_cpp.backend(lc)
    buft = llama_cpp.host_buffer_type(lc) if how == "registry" or n or how == "array" else None
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers, mp.split_mode, mp.main_gpu = int(layers) + 1, lc.LLAMA_SPLIT_MODE_NONE, 0
    if how == "nommap":
        mp.use_mmap = False
    keep = None
    if n or how == "array":
        keep = llama_cpp.expert_overrides(n, buft)
        mp.tensor_buft_overrides = ctypes.cast(keep, ctypes.c_void_p)
    for path in runtime_libraries():
        print(f"{variant}: mapped {path}", flush=True)
    print(f"{variant}: loading", flush=True)
    model = lc.llama_model_load_from_file(str(gguf).encode(), mp)
    print(f"{variant}: loaded {bool(model)}", flush=True)
    cp = lc.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, cp)
    print(f"{variant}: context {bool(ctx)}", flush=True)
    b = lc.llama_batch_init(40, 0, 1)
    for i in range(40):
        b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = 7 + i, i, 1, 0, i == 39
    b.n_tokens = 40
    rc = lc.llama_decode(ctx, b)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, 39), shape=(vocab,))
    line = f"{variant}: ok, decode rc {rc}, argmax {int(row.argmax())}"
    print(line, flush=True)
    del keep  # the override array lives until the model is done with it
    return line


if __name__ == "__main__":
    main()
