"""The `llama-cpp` competitor: llama.cpp (llama-cpp-python's bindings to its C API) running a GGUF
conversion of the worker's MoE checkpoint, with the routed experts of the first `n_cpu_moe` layers
kept in host memory and computed by llama.cpp's CPU backend (its `--n-cpu-moe`), every other tensor
on the GPU (core/conditions/llama_cpp.py: the placement and what it costs the allowance).

**Conversion.** `write_gguf` writes the checkpoint as llama.cpp's own converter (convert_hf_to_gguf.py,
which ships with llama.cpp's source, not with its wheels) would for these three families, through
the `gguf` package (llama.cpp's gguf-py): Mixtral as architecture `llama` (its q and k projections
permuted to llama.cpp's interleaved rotary pairs), Qwen3-MoE as `qwen3moe`, OLMoE as `olmoe`; each
layer's experts stacked into one (experts, out, in) tensor a projection; the model's dtype kept,
norms and routers in float32; config.json as transformers reads it (defaults filled: the rms epsilon
and rotary base the reference runs with), a scaled rotary embedding refused. A
synthetic checkpoint has no tokenizer and none is needed (token ids go in, logits come out), so the
vocabulary is llama.cpp's `none` type of `vocab_size` placeholder tokens. Converted once per
checkpoint and dtype, under the model cache.

**LlamaPlacement.** llama-cpp-python's `Llama` passes no tensor buffer overrides (its `llama_model_params`
declares `tensor_buft_overrides` an unused pointer; abetlen/llama-cpp-python#2007), so the model is
loaded through the C API here with that field filled: a NULL-terminated array of {pattern, buffer
type} naming the expert tensors of layers 0..n-1 and the CPU device's buffer type, what llama.cpp's
own `--n-cpu-moe` builds (common/arg.cpp). The device bytes llama.cpp's load and context took are
measured (the device's free memory before and after) and a placement over the allowance is refused.

**Episodes.** One `llama_decode` a call: the prefill of every sequence together (one sequence id
each, one KV cache, computed in llama.cpp's default micro-batches of 512 tokens), then a token a sequence per decode call, fed its argmax or the teacher-forced
token; the last position's float32 logits of every sequence read back (what synchronises the call).
Flash attention is off (the device build compiles without it, which halves its build time) and
llama.cpp's CUDA graphs are its own. Bytes are counted by llama.cpp's scheduler's rules (the kind's
module docstring), on a CUDA worker only: a CPU worker's llama.cpp moves nothing.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from packbench.core.conditions.llama_cpp import (EXTRA, F32, OP_OFFLOAD_MIN_BATCH, UBATCH, LlamaPlacement, PlacementRefused,
                                                 choose_placement, kv_bytes, kv_cells, layer_bytes, placement, shape)
from packbench.core.errors import PackbenchError, PlacementDoesNotFit
from packbench.engine.episode import EpisodeOutput
from packbench.engine.ledger import Recorder
from packbench.engine.placed import files_key, place_once

# config.json's model_type -> llama.cpp's architecture name
ARCHS = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
# Each family's names of a layer's router and expert projections (gate, up, down).
ROUTERS = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate", "olmoe": "mlp.gate"}
EXPERT_NAMES = {"mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                            "block_sparse_moe.experts.{e}.w2"),
                "qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
                "olmoe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")}
# llama.cpp's `--n-cpu-moe` patterns: the routed experts' tensors of one layer (common/arg.cpp).
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
CPU_DEVICE_TYPE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
GGUF_NAME = "model.gguf"


class LlamaCppUnavailable(PackbenchError):
    """llama-cpp-python is missing or built without CUDA on a GPU worker, the model is not one it can
    convert, or the placement does not fit (one line, with the fix)."""


def fix() -> str:
    return (f"pip install 'packbench[{EXTRA}]' (llama-cpp-python builds llama.cpp from source; for a GPU worker set "
            f"CMAKE_ARGS='-DGGML_CUDA=on' first)")


def cxx_runtime_global() -> None:
    """The process's C++ runtime (libstdc++) made global before llama-cpp-python loads its libraries.

    llama-cpp-python opens libllama and the ggml libraries RTLD_GLOBAL. A CUDA build of libggml-cuda
    (nvcc) defines and exports template instances of the C++ runtime's own (`std::ostream::_M_insert<long>`,
    locale parts); where libstdc++ is not yet in the global scope (a plain Python process that has
    imported torch: its extensions load it RTLD_LOCAL), those exports come first in it, libllama's
    stream output binds to them and crashes in its first `print_info` (SIGSEGV on an H100 machine,
    torch 2.11, llama-cpp-python 0.3.36 built there; docs/experiments/competitors.md). A Ray worker had
    libstdc++ global already, which is why the screens ran. Promoting the loaded libstdc++ to the
    global scope first makes every such reference bind to the runtime itself."""
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:  # no libstdc++ by that name (not glibc Linux): nothing to promote
        pass


def library():
    """llama-cpp-python's `llama_cpp` module; LlamaCppUnavailable (one line, with the fix) where it is missing."""
    try:
        cxx_runtime_global()
        return importlib.import_module("llama_cpp")
    except (ImportError, OSError) as e:  # OSError: its shared library fails to load
        raise LlamaCppUnavailable(f"condition policy llama-cpp requires llama-cpp-python ({e}): {fix()}") from None


def model_config(model_dir: Path) -> dict:
    """config.json as transformers reads it, its defaults filled in: what the reference runs with,
    so the GGUF says the same (a rotary base or head width the file leaves out, say)."""
    import transformers

    from packbench.core.text import one_line

    try:
        return transformers.AutoConfig.from_pretrained(str(model_dir)).to_dict()
    except Exception as e:  # noqa: BLE001 - any unreadable config is one line
        raise LlamaCppUnavailable(f"transformers cannot read {model_dir}/config.json ({one_line(str(e))[:200]}); "
                                  f"fix config.json") from None


def refusal(device: torch.device, config: dict) -> str | None:
    """Why condition llama-cpp cannot run this model on this worker (None: it can)."""
    if config.get("model_type") not in ARCHS:
        return (f"condition policy llama-cpp converts {', '.join(ARCHS)} checkpoints to GGUF, this one is "
                f"{config.get('model_type')!r}; drop the condition")
    rope = (config.get("rope_parameters") or {}).get("rope_type") or "default"
    if rope != "default" or config.get("rope_scaling"):
        return (f"condition policy llama-cpp converts plain rotary embeddings only, this checkpoint's rope type is "
                f"{rope if rope != 'default' else config.get('rope_scaling')!r}; drop the condition")
    if device.type == "cuda" and not library().llama_supports_gpu_offload():
        return ("condition policy llama-cpp on a GPU worker needs llama-cpp-python built with CUDA, and this one "
                "runs on the CPU only: reinstall it with CMAKE_ARGS='-DGGML_CUDA=on' pip install --force-reinstall "
                "--no-cache-dir llama-cpp-python")
    return None


# -- conversion ------------------------------------------------------------------------------------


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's rows from transformers' rotate-half pairs to llama.cpp's interleaved
    ones (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_plan(config: dict) -> list[tuple[str, tuple[str, ...], str]]:
    """Every GGUF tensor in file order: (name, the checkpoint tensors it is made of, how): `copy`,
    `f32` (kept in float32), `q`/`k` (permuted for llama's rotary pairs), `stack` (experts)."""
    fam, layers = config["model_type"], config["num_hidden_layers"]
    llama = ARCHS[fam] == "llama"
    out = [("token_embd.weight", ("model.embed_tokens.weight",), "copy")]
    n_exp = shape(config).experts
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(f"blk.{i}.attn_norm.weight", (p + "input_layernorm.weight",), "f32"),
                (f"blk.{i}.attn_q.weight", (p + "self_attn.q_proj.weight",), "q" if llama else "copy"),
                (f"blk.{i}.attn_k.weight", (p + "self_attn.k_proj.weight",), "k" if llama else "copy"),
                (f"blk.{i}.attn_v.weight", (p + "self_attn.v_proj.weight",), "copy"),
                (f"blk.{i}.attn_output.weight", (p + "self_attn.o_proj.weight",), "copy")]
        if fam in ("qwen3_moe", "olmoe"):
            out += [(f"blk.{i}.attn_q_norm.weight", (p + "self_attn.q_norm.weight",), "f32"),
                    (f"blk.{i}.attn_k_norm.weight", (p + "self_attn.k_norm.weight",), "f32")]
        out += [(f"blk.{i}.ffn_norm.weight", (p + "post_attention_layernorm.weight",), "f32"),
                (f"blk.{i}.ffn_gate_inp.weight", (p + ROUTERS[fam] + ".weight",), "f32")]
        for which, pattern in zip(("gate", "up", "down"), EXPERT_NAMES[fam]):
            out.append((f"blk.{i}.ffn_{which}_exps.weight",
                        tuple(p + pattern.format(e=e) + ".weight" for e in range(n_exp)), "stack"))
    out.append(("output_norm.weight", ("model.norm.weight",), "f32"))
    if not config.get("tie_word_embeddings"):
        out.append(("output.weight", ("lm_head.weight",), "copy"))  # tied: llama.cpp reuses token_embd
    return out


def _metadata(w, config: dict) -> None:
    s = shape(config)
    hd, ff = s.head_dim, s.intermediate
    w.add_name("packbench synthetic checkpoint")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(ff if config["model_type"] != "qwen3_moe" else config["intermediate_size"])
    w.add_expert_feed_forward_length(ff)
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_expert_count(s.experts)
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_vocab_size(config["vocab_size"])
    w.add_tokenizer_model("none")  # no tokenizer: vocab_size placeholder tokens (module docstring)


def write_gguf(model_dir: Path, out: Path, *, dtype: str) -> int:
    """`model_dir` (an MoE checkpoint of a family in ARCHS) as GGUF at `out`, weights in `dtype`
    (float32, float16 or bfloat16), streamed one tensor at a time. Returns the tensors written."""
    import gguf
    from safetensors import safe_open

    config = model_config(model_dir)
    tdtype = getattr(torch, dtype)
    where = {}  # tensor name -> its open file
    for f in sorted(model_dir.glob("*.safetensors")):
        h = safe_open(str(f), "pt")
        where.update({k: h for k in h.keys()})
    plan = gguf_plan(config)
    missing = [n for _, names, _ in plan for n in names if n not in where]
    if missing:
        raise LlamaCppUnavailable(f"{model_dir} lacks tensor {missing[0]} (and {len(missing) - 1} more) that a "
                                  f"{config['model_type']} GGUF needs; is it a complete checkpoint?")

    def target(how: str) -> torch.dtype:
        return torch.float32 if how == "f32" else tdtype

    def shape(names: tuple[str, ...], how: str) -> tuple[int, ...]:
        one = tuple(where[names[0]].get_slice(names[0]).get_shape())
        return (len(names), *one) if how == "stack" else one

    def tensor(names: tuple[str, ...], how: str) -> torch.Tensor:
        if how == "stack":
            t = torch.stack([where[n].get_tensor(n) for n in names])
        else:
            t = where[names[0]].get_tensor(names[0])
        if how in ("q", "k"):
            heads = config["num_attention_heads"] if how == "q" else config["num_key_value_heads"]
            t = permute(t, heads)
        return t.to(target(how)).contiguous()

    def array(t: torch.Tensor) -> np.ndarray:
        return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()

    raw = {torch.bfloat16: gguf.GGMLQuantizationType.BF16}
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}
    w = gguf.GGUFWriter(str(out), ARCHS[config["model_type"]])
    _metadata(w, config)
    for name, names, how in plan:
        t = target(how)
        dims = shape(names, how)
        w.add_tensor_info(name, dims, np.dtype(np_dtype[t]), int(np.prod(dims)) * t.itemsize, raw_dtype=raw.get(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, names, how in plan:
        w.write_tensor_data(array(tensor(names, how)))
    w.close()
    return len(plan)


def converted(model_dir: Path, cache: Path, *, dtype: str) -> Path:
    """The GGUF of `model_dir` in `dtype`, written once per checkpoint (keyed by its files' names,
    sizes and mtimes) and dtype under `cache`; a half-written one (no `complete` marker) is written
    again. A cache that refuses it (full, read-only) is one LlamaCppUnavailable."""
    root = cache / "gguf" / files_key(sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"], dtype)

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        n = write_gguf(model_dir, tmp / GGUF_NAME, dtype=dtype)
        (tmp / "complete").write_text(json.dumps({"checkpoint": str(model_dir), "dtype": dtype, "tensors": n}))

    try:
        return place_once(root, build, whole=lambda d: (d / "complete").exists()) / GGUF_NAME
    except OSError as e:
        raise LlamaCppUnavailable(f"cannot write the GGUF of {model_dir} into the model cache {cache} "
                                  f"({e.strerror or e}); free space there, or give --model-cache "
                                  f"(PACKBENCH_MODEL_CACHE) a writable directory with room") from None


# -- llama.cpp through its C API -------------------------------------------------------------------


class BuftOverride(ctypes.Structure):
    """llama.h `struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def host_buffer_type(lc) -> int:
    """The CPU device's buffer type (ggml-backend.h), from the libraries llama-cpp-python ships."""
    lib = Path(lc.__file__).parent / "lib"
    ggml, base = ctypes.CDLL(str(lib / "libggml.so")), ctypes.CDLL(str(lib / "libggml-base.so"))
    ggml.ggml_backend_dev_by_type.restype, ggml.ggml_backend_dev_by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    device = ggml.ggml_backend_dev_by_type(CPU_DEVICE_TYPE)
    if not device:
        raise LlamaCppUnavailable("llama.cpp found no CPU device to keep the experts on")
    return base.ggml_backend_dev_buffer_type(device)


def expert_overrides(layers: int, buft: int) -> ctypes.Array:
    """{pattern, buft} for the experts of layers 0..layers-1, NULL-terminated (kept alive by the caller)."""
    rows = [BuftOverride(rf"blk\.{i}{EXPERT_TENSORS}".encode(), buft) for i in range(layers)]
    return (BuftOverride * (len(rows) + 1))(*rows, BuftOverride(None, None))


@functools.cache
def quiet_log():
    """A log callback that drops llama.cpp's lines, made once and kept alive (llama.cpp calls it later)."""
    lc = library()
    return lc.llama_log_callback(lambda level, text, user_data: None)


@functools.cache
def backend(lc) -> None:
    """llama.cpp's process-wide start (llama.h: `llama_backend_init`, once), its log lines dropped
    unless PACKBENCH_LLAMA_LOG is set (then on stderr, as llama.cpp writes them)."""
    if not os.environ.get("PACKBENCH_LLAMA_LOG"):
        lc.llama_log_set(quiet_log(), ctypes.c_void_p(0))
    lc.llama_backend_init()


def _device_free(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


@dataclass(frozen=True)
class LlamaCppStats:
    """What building the model cost and the placement it runs with, recorded in every episode."""

    library_version: str
    load_s: float  # conversion (first time only) + llama.cpp's load and context, to the last synchronisation
    convert_s: float  # 0 when the GGUF was already in the model cache
    gguf_bytes: int
    placement: dict  # core LlamaPlacement.as_dict(): n_cpu_moe and the allowance's arithmetic behind it
    device_bytes: int  # what llama.cpp's load and context took on the device, measured (0 on the CPU)
    gpu_layers: int  # llama.cpp's n_gpu_layers (0 on a CPU worker)
    threads: int  # llama.cpp's CPU threads (the host experts' arithmetic)
    op_offload: bool
    flash_attn: bool

    def as_dict(self) -> dict:
        return asdict(self)


class LlamaCppModel:
    """The checkpoint under llama.cpp, on the worker's device. Eager only; one decode per call."""

    mode = "eager"
    can_shelve = False
    # Its device memory is llama.cpp's, outside torch's allocator: the worker measures it as part of
    # the context while it is held, and measures the context again once it is released.
    outside_allocator = True

    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: torch.device, params: dict,
                 allowance_bytes: int, context_bytes: int, capacity: int, batch: int, cache: Path,
                 threads: int | None = None, archived: dict | None = None) -> None:
        """`archived`: an archived episode's `offload` section, whose n_cpu_moe a re-execution runs
        again instead of choosing one."""
        self._ctx = self._model = None
        lc = library()
        config = model_config(Path(model_dir))
        why = refusal(device, config)
        if why is not None:
            raise LlamaCppUnavailable(why)
        dtype_name = str(dtype).removeprefix("torch.")
        cuda = device.type == "cuda"
        t0 = time.perf_counter()
        gguf_path = converted(Path(model_dir), cache, dtype=dtype_name)
        convert_s = time.perf_counter() - t0
        sizing = dict(dtype=dtype_name, allowance=allowance_bytes, context=context_bytes, batch=batch, capacity=capacity)
        try:
            if archived is not None:  # a re-execution: the archived n_cpu_moe, not one chosen at this context
                was = (archived.get("placement") or {})
                p = placement(config, int(was.get("n_cpu_moe", 0)), chosen=bool(was.get("chosen")), **sizing)
                if p.needed > allowance_bytes:
                    raise PlacementDoesNotFit(f"the archived llama.cpp placement (n_cpu_moe {p.n_cpu_moe}) needs "
                                              f"{-(-p.needed // 2**20)} MiB on this device, over the allowance")
            else:
                p = choose_placement(config, params, **sizing)
        except PlacementRefused as e:
            raise LlamaCppUnavailable(str(e)) from None
        self.plan: LlamaPlacement = p
        self.config, self.device, self.batch, self.capacity = config, device, batch, capacity
        self.vocab, self.layers = config["vocab_size"], config["num_hidden_layers"]
        self.recorder = Recorder(self.layers)
        self.threads = threads or torch.get_num_threads()
        self.op_offload = params.get("op_offload", "off") == "on"
        self._lc = lc
        backend(lc)
        free0 = _device_free(device) if cuda else 0
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = self.layers + 1 if cuda else 0  # every layer and the output
        mp.split_mode, mp.main_gpu = lc.LLAMA_SPLIT_MODE_NONE, device.index or 0
        self._overrides = expert_overrides(p.n_cpu_moe, host_buffer_type(lc)) if p.n_cpu_moe else None
        if self._overrides is not None:
            mp.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self._model = lc.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self._model:
            raise LlamaCppUnavailable(f"llama.cpp could not load {gguf_path} (the GGUF of {model_dir})")
        cp = lc.llama_context_default_params()
        cells = kv_cells(batch=batch, capacity=capacity)
        # one llama_decode a call (n_batch), computed in llama.cpp's default micro-batches (n_ubatch)
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = cells, cells, min(cells, UBATCH), batch
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.op_offload, cp.kv_unified, cp.no_perf = self.op_offload, True, True
        self._ctx = lc.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.release()
            raise LlamaCppUnavailable(f"llama.cpp could not make a context of {cells} cells for {model_dir}")
        used = free0 - _device_free(device) if cuda else 0
        if cuda and context_bytes + used > allowance_bytes:
            self.release()
            raise LlamaCppUnavailable(f"llama.cpp's placement (n_cpu_moe {p.n_cpu_moe}) took {used // 2**20} MiB on the "
                                      f"device beside the {context_bytes // 2**20} MiB CUDA context, over the "
                                      f"allowance of {allowance_bytes // 2**20} MiB: give a larger n_cpu_moe")
        self._expert_bytes = layer_bytes(config, dtype=dtype_name)["experts"]  # a layer's, all experts
        self.experts = shape(config).experts
        self.link = cuda  # a CPU worker's llama.cpp moves nothing
        self.stats = LlamaCppStats(library_version=importlib.metadata.version("llama_cpp_python"),
                                   load_s=time.perf_counter() - t0, convert_s=convert_s,
                                   gguf_bytes=gguf_path.stat().st_size, placement=p.as_dict(), device_bytes=used,
                                   gpu_layers=mp.n_gpu_layers, threads=self.threads, op_offload=self.op_offload,
                                   flash_attn=False)

    def release(self) -> None:
        """Free llama.cpp's context and model (host and device memory); safe to call twice."""
        if self._ctx:
            self._lc.llama_free(self._ctx)
        if self._model:
            self._lc.llama_model_free(self._model)
        self._ctx = self._model = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: the bindings may be gone already
            pass

    def new_cache(self, capacity: int | None = None, *, mode: str | None = None, batch: int = 1):
        raise TypeError("a llama-cpp model runs whole episodes (LlamaCppModel.episode), not calls")

    def forward(self, ids, cache):
        raise TypeError("a llama-cpp model runs whole episodes (LlamaCppModel.episode), not calls")

    def _charge(self, tokens: int) -> None:
        """One call's bytes by llama.cpp's scheduler's rules (module docstring), host layers only, on a
        link (`self.link`: a CUDA worker's): with op offload a call of OP_OFFLOAD_MIN_BATCH tokens or
        more copies each host layer's experts, charged as every one (rows of one expert each, at most)."""
        if not self.link:
            return
        h, k, e = self.config["hidden_size"], self.config["num_experts_per_tok"], self.experts
        copied = self.op_offload and tokens >= OP_OFFLOAD_MIN_BATCH
        for layer in range(self.plan.n_cpu_moe):
            self.recorder.add(layer, rows=e if copied else 0, weight_bytes=self._expert_bytes if copied else 0,
                              index_bytes=tokens * h * F32, d2h_bytes=tokens * (h + 2 * k) * F32)

    def episode(self, prompts: list[list[int]], *, continuation: int, mode: str,
                forced: list[list[int]] | None) -> EpisodeOutput:
        """`continuation` calls over the batch `prompts`: a prefill, then a token a sequence a call."""
        lc, ctx = self._lc, self._ctx
        if mode != "eager":
            raise ValueError("a llama-cpp condition runs in mode eager only")
        batch, prefix = len(prompts), len(prompts[0])
        if batch != self.batch or prefix + continuation > self.capacity:
            raise ValueError(f"llama.cpp was placed for {self.batch} sequences of {self.capacity} positions, got "
                             f"{batch} of {prefix + continuation}")
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        b = lc.llama_batch_init(batch * prefix, 0, 1)
        recorder = self.recorder
        recorder.calls = []
        tokens: list[list[int]] = [[] for _ in range(batch)]
        rows: list[np.ndarray] = []
        try:
            n = 0
            for s, p in enumerate(prompts):
                for j, t in enumerate(p):
                    b.token[n], b.pos[n], b.n_seq_id[n], b.seq_id[n][0], b.logits[n] = t, j, 1, s, j == prefix - 1
                    n += 1
            b.n_tokens = n
            outputs = [s * prefix + prefix - 1 for s in range(batch)]
            t_start = time.perf_counter()
            first_logit_at = t_start
            for call in range(continuation):
                recorder.begin(phase="prefill" if call == 0 else "decode", tokens=b.n_tokens)
                t0 = time.perf_counter()
                rc = lc.llama_decode(ctx, b)
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc} at call {call}")
                row = np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.vocab,)).copy()
                                for i in outputs])  # reading them synchronises the call
                t1 = time.perf_counter()
                self._charge(b.n_tokens)
                recorder.end(wall_s=t1 - t0, logits_d2h_bytes=row.size * 4)
                if call == 0:
                    first_logit_at = t1
                rows.append(row)
                for s in range(batch):
                    token = int(row[s].argmax())
                    tokens[s].append(token)
                    fed = token if forced is None or call == continuation - 1 else int(forced[s][call])
                    b.token[s], b.pos[s], b.n_seq_id[s], b.seq_id[s][0], b.logits[s] = fed, prefix + call, 1, s, True
                b.n_tokens = batch
                outputs = list(range(batch))
            wall = time.perf_counter() - t_start
        finally:
            lc.llama_batch_free(b)
        cuda = self.device.type == "cuda"
        held = self.stats.device_bytes
        return EpisodeOutput(
            tokens=tokens, logits=np.stack(rows, axis=1), calls=list(recorder.calls), wall_s=wall,
            kv_bytes=kv_bytes(self.config, batch=batch, capacity=self.capacity),
            peak_allocated_bytes=held + torch.cuda.max_memory_allocated(self.device) if cuda else 0,
            peak_reserved_bytes=held + torch.cuda.max_memory_reserved(self.device) if cuda else 0,
            first_logit_at=first_logit_at, mode="eager", decode_graph=None, batch=batch)
