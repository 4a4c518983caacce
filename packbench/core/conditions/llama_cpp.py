"""`llama-cpp`: llama.cpp itself (through llama-cpp-python) running an MoE checkpoint converted to
GGUF, every layer on the GPU but the routed experts of the first `n_cpu_moe` layers, which stay in
host memory and are computed there by llama.cpp's CPU backend: what its `--n-cpu-moe N` option
does. A competitor in tier approximate (its kernels are its own; host arithmetic is not the GPU's
bit for bit), judged by the fidelity gate against dense-stream. Its runtime is
engine/conditions/llama_cpp.py over engine/llama_cpp.py.

The placement is frozen in the protocol where the condition gives `n_cpu_moe`. Omitted, the worker
chooses the fewest host layers whose device part fits the allowance beside the CUDA context
(`choose_placement`): llama.cpp's weights as the GGUF holds them (the token embedding stays on the
host, as llama.cpp keeps its input layer; norms and routers in float32), its float16 KV cache for
the episode's positions, and its compute buffers (`working_bytes`, from above). The worker measures
what llama.cpp's load and context took on the device and refuses a placement that went over.

What crosses the link is llama.cpp's scheduler's doing, and packbench counts it by its rules
(ggml-backend.cpp, ggml-cuda.cu), not by observing copies: for each host layer the normed hidden
states, routing ids and weights go down and the experts' summed output comes up, in float32; with
`op_offload: on` (llama.cpp's default; packbench's is off, the faster measured), a call of at least OP_OFFLOAD_MIN_BATCH tokens copies the host experts it routes
to the GPU for the op, which the ledger charges as every expert of every host layer (an upper bound:
llama.cpp copies only the routed ones, grouped, and packbench does not see its routing).

Torch-free: core. `config` below is an MoE config.json's fields (core/moe.py moe_shape reads them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from packbench.core.conditions.base import (MODE_PARAM, CallInputs, ChoiceParam, Competitor, ConditionKind, IntParam,
                                            RecordContext, differs, recorded_plan)

LIBRARY = "llama_cpp"  # llama-cpp-python's import name
EXTRA = "llamacpp"  # pyproject.toml's [llamacpp] extra brings it (and gguf, the converter's writer)
MIB = 1 << 20
F32, KV_BYTES = 4, 2  # llama.cpp's activations and its default float16 KV cache
OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda.cu: a host weight's op of at least this many tokens runs on the GPU
KV_PAD = 256  # llama.cpp rounds its KV cache's cells up to a multiple of this
UBATCH = 512  # llama.cpp's default micro-batch (n_ubatch): a longer prefill is computed 512 tokens at a time
# cuBLAS' workspace, llama.cpp's CUDA pools and graphs, beside the estimate: on an H100 at Qwen3-30B-A3B's
# shape (12 layers, fp16, 144 positions) llama.cpp took 434 MB beyond its weights and KV cache, which the
# estimate without slack put at 35 MB (bench/llamacpp_screen_device.sh)
SLACK = 512 * MIB
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CAPTURE_REFUSAL = "llama.cpp captures its own CUDA graphs of each decode step (ggml-cuda's graph reuse)"


def shape(config: Mapping[str, Any]):
    """The byte arithmetic's view of an MoE config.json (core/moe.py shape_of_config: its family's
    keys, kv heads and head width defaulted as transformers does)."""
    from packbench.core.moe import shape_of_config  # core/moe.py imports this package: not at import time

    return shape_of_config(config)


def layer_bytes(config: Mapping[str, Any], *, dtype: str) -> dict[str, int]:
    """One decoder layer's GGUF tensors in bytes, by what llama.cpp does with them: `experts` (the
    three stacked expert tensors) and `rest` (attention projections in the model's dtype; norms, QK
    norms and the router in float32, as the converter writes them)."""
    s, e = shape(config), DTYPE_BYTES[dtype]
    attention = (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.hidden * e
    qk_norms = {"qwen3_moe": 2 * s.head_dim, "olmoe": (s.heads + s.kv_heads) * s.head_dim}.get(config["model_type"], 0)
    return {"experts": 3 * s.experts * s.intermediate * s.hidden * e,
            "rest": attention + (2 * s.hidden + qk_norms + s.experts * s.hidden) * F32}


def kv_cells(*, batch: int, capacity: int) -> int:
    """llama.cpp's KV cache cells for `batch` sequences of `capacity` positions (padded)."""
    n = batch * capacity
    return -(-n // KV_PAD) * KV_PAD


def kv_bytes(config: Mapping[str, Any], *, batch: int, capacity: int) -> int:
    s = shape(config)
    return 2 * s.layers * kv_cells(batch=batch, capacity=capacity) * s.kv_heads * s.head_dim * KV_BYTES


def working_bytes(config: Mapping[str, Any], *, batch: int, capacity: int) -> int:
    """llama.cpp's compute buffer on the device, from above: one micro-batch of a prefill (at most
    UBATCH tokens: the hidden states and the attention's and FFN's intermediates, float32, the
    attention scores of every head against every cell, the routed experts' intermediates), logits
    of every sequence's last position, and SLACK."""
    s, t = shape(config), min(batch * capacity, UBATCH)
    acts = t * (8 * s.hidden + 4 * s.heads * s.head_dim + 3 * s.k * s.intermediate + s.experts) * F32
    scores = s.heads * t * kv_cells(batch=batch, capacity=capacity) * F32
    return acts + scores + batch * s.vocab * F32 + SLACK


@dataclass(frozen=True)
class LlamaPlacement:
    """llama.cpp's placement for one screen and the allowance's arithmetic behind it (bytes; written
    into every episode record). `chosen`: n_cpu_moe was chosen here (the condition did not give it)."""

    n_cpu_moe: int
    chosen: bool
    allowance: int
    context: int
    weights_gpu: int  # every GGUF tensor llama.cpp places on the device at this n_cpu_moe
    weights_host: int  # the token embedding and the host layers' experts
    kv: int
    working: int

    @property
    def needed(self) -> int:
        return self.context + self.weights_gpu + self.kv + self.working

    def as_dict(self) -> dict:
        return {**asdict(self), "needed": self.needed}


class PlacementRefused(ValueError):
    """No n_cpu_moe fits the allowance, or the given one does not (one line, with the fix)."""


def placement(config: Mapping[str, Any], n_cpu_moe: int, *, dtype: str, allowance: int, context: int, batch: int,
              capacity: int, chosen: bool) -> LlamaPlacement:
    layers, h, v = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    per = layer_bytes(config, dtype=dtype)
    e = DTYPE_BYTES[dtype]
    output = v * h * e + h * F32  # lm_head and the final norm
    gpu = layers * per["rest"] + (layers - n_cpu_moe) * per["experts"] + output
    host = v * h * e + n_cpu_moe * per["experts"]
    return LlamaPlacement(n_cpu_moe=n_cpu_moe, chosen=chosen, allowance=allowance, context=context, weights_gpu=gpu,
                     weights_host=host, kv=kv_bytes(config, batch=batch, capacity=capacity),
                     working=working_bytes(config, batch=batch, capacity=capacity))


def choose_placement(config: Mapping[str, Any], params: Mapping[str, Any], *, dtype: str, allowance: int,
                     context: int, batch: int, capacity: int) -> LlamaPlacement:
    """The condition's `n_cpu_moe` where it gives one (refused when it does not fit), else the
    fewest host layers that fit: llama.cpp's fastest placement under the allowance."""
    layers = config["num_hidden_layers"]
    given = params.get("n_cpu_moe")
    if given is not None:
        if given > layers:
            raise PlacementRefused(f"condition policy llama-cpp: n_cpu_moe {given} is more than the model's "
                                   f"{layers} layers; give at most {layers}")
        p = placement(config, given, dtype=dtype, allowance=allowance, context=context, batch=batch,
                      capacity=capacity, chosen=False)
        if p.needed > allowance:
            raise PlacementRefused(f"condition policy llama-cpp with n_cpu_moe {given} needs {-(-p.needed // MIB)} MiB "
                                   f"on the device, the allowance is {allowance // MIB} MiB: raise n_cpu_moe (or omit "
                                   f"it to choose), or raise allowance_mib")
        return p
    for n in range(layers + 1):
        p = placement(config, n, dtype=dtype, allowance=allowance, context=context, batch=batch, capacity=capacity,
                      chosen=True)
        if p.needed <= allowance:
            return p
    raise PlacementRefused(f"condition policy llama-cpp needs {-(-p.needed // MIB)} MiB on the device even with every "
                           f"layer's experts in host memory, the allowance is {allowance // MIB} MiB: raise "
                           f"allowance_mib or drop the condition")


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    # Never an OPT model's (refused there); an MoE plan estimates through core/moe.py call_bytes.
    return call.packet()


def record_problems(params: Mapping[str, Any], record: Mapping[str, Any], ctx: RecordContext) -> list[str]:
    """What the auditor finds wrong with a finished llama-cpp episode's `offload.placement`: a
    LlamaPlacement's record (its sum as `as_dict` writes it) at the protocol's allowance, the condition's
    frozen n_cpu_moe (chosen on the worker exactly where the condition omits it), fitting the
    allowance, and for a synthetic shape the whole placement `choose_placement`'s at the recorded
    context. An edited placement DISAGREEs."""
    p, out = recorded_plan(record, "placement", LlamaPlacement, "llama.cpp's placement")
    if p is None:
        return out
    got = record["offload"]["placement"]
    given = params.get("n_cpu_moe")
    want = {"allowance": ctx.allowance_bytes, "chosen": given is None, **({} if given is None else {"n_cpu_moe": given})}
    out += [f"offload.placement: {k} {got[k]} is not the protocol's {v}" for k, v in want.items() if got[k] != v]
    if p.needed > p.allowance:
        out.append(f"offload.placement: needs {p.needed} bytes, over the allowance of {p.allowance}: the worker "
                   f"refuses such a placement")
    if ctx.config is not None and not out:
        try:
            want_p = choose_placement(ctx.config, params, dtype=ctx.dtype, allowance=ctx.allowance_bytes,
                                      context=p.context, batch=ctx.batch, capacity=ctx.capacity)
        except PlacementRefused as e:
            return [f"offload.placement: recorded a placement where the rule refuses: {e}"]
        wrong = differs(got, want_p.as_dict())
        if wrong:
            out.append(f"offload.placement: {wrong} (llama.cpp's placement of this model at its context)")
    return out


KIND = ConditionKind(
    name="llama-cpp",
    summary="llama.cpp (llama-cpp-python) on a GGUF conversion: every layer on the GPU but the first n_cpu_moe "
            "layers' experts, kept and computed in host memory (--n-cpu-moe)",
    params={"n_cpu_moe": IntParam(minimum=0, optional=True),
            # off: the fastest measured (an H100 at Qwen3's shape: TTFT 275.5 ms against 1067.5 with it on,
            # decode 10.10 against 10.19 ms/token; llama-bench's pp128 3.6x); llama.cpp's own default is on
            "op_offload": ChoiceParam(choices=("on", "off"), default="off"),
            "mode": MODE_PARAM},
    h2d_bytes=h2d_bytes,
    tier="approximate",
    bound="at most",
    since=11,  # the newest schema when it was added: no body frozen before it changes
    competitor=Competitor(library=lambda params: LIBRARY, fastest_mode=lambda params: "eager",
                          capture_refusal=lambda params: CAPTURE_REFUSAL, extra=EXTRA,
                          record_problems=record_problems),
    families=("moe",),
    holds=lambda params: None,
)
