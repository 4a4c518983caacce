"""`zero-inference`: DeepSpeed ZeRO-Inference, ZeRO stage 3 with every parameter offloaded to host
memory and gathered onto the device layer by layer with DeepSpeed's own prefetching (a competitor;
stock transformers' modules, so tier exact, judged for faithfulness); its runtime is
engine/conditions/zero_inference.py over engine/zero_inference.py."""

from typing import Any, Mapping

from packbench.core.conditions.base import MODE_PARAM, CallInputs, Competitor, ConditionKind

LIBRARY = "deepspeed"
EXTRA = "offload"  # pyproject.toml's [offload] extra brings it
MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def activation_bytes(config: Mapping[str, Any], *, capacity: int, batch: int, element_bytes: int) -> int:
    """One call's activations, at most: a prefill of `capacity` tokens of each of `batch` sequences
    (hidden states, query/key/value and the FFN's hidden, eager attention's scores; logits of one
    position, float32). `config`: an OPT config.json's fields."""
    e, t = element_bytes, capacity * batch
    return (t * (6 * config["hidden_size"] + config["ffn_dim"]) * e
            + batch * config["num_attention_heads"] * capacity * capacity * e * 2 + batch * config["vocab_size"] * 4)


def minimum_allowance(config: Mapping[str, Any], *, dtype: str, capacity: int, batch: int) -> int:
    """The smallest allowance DeepSpeed's ZeRO-3 offload can run an OPT `config` (config.json) in,
    the CUDA context aside: the largest module's parameters gathered (the tied token embedding,
    vocab x hidden), the KV cache, one call's activations and the persistent vectors (engine/zero_inference.py ZeroBudget,
    torch-free; the worker adds the measured context and refuses with the same words)."""
    e = DTYPE_BYTES[dtype]
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = 2 * layers * capacity * h * e * batch
    activations = activation_bytes(config, capacity=capacity, batch=batch, element_bytes=e)
    # DeepSpeed keeps every parameter of at most `hidden` elements on the device: per layer the four
    # attention biases, fc2's bias and two LayerNorms (9 x hidden), and the final LayerNorm
    persistent = (9 * layers + 2) * h * e
    return vocab * h * e + kv + activations + persistent


def allowance_refusal(config: Mapping[str, Any], *, dtype: str, capacity: int, batch: int,
                      allowance_bytes: int) -> str | None:
    """One line where the allowance is below `minimum_allowance`, naming the allowance it needs."""
    need = minimum_allowance(config, dtype=dtype, capacity=capacity, batch=batch)
    if allowance_bytes >= need:
        return None
    return (f"condition policy zero-inference needs an allowance of at least {-(-need // MIB)} MiB beside the CUDA "
            f"context (the token embedding's {config['vocab_size'] * config['hidden_size']} parameters gathered "
            f"beside the KV cache and activations), the protocol gives {allowance_bytes // MIB} MiB: raise "
            f"allowance_mib or drop the condition")


CAPTURE_REFUSAL = "DeepSpeed's ZeRO-3 hooks gather and free each module's parameters in Python on every call"


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    """Every parameter every call, OPT's tied embedding twice (the embedding, then `lm_head`): about,
    since the persistent vectors (<= hidden elements) stay on the device after the first calls."""
    shape = call.shape
    return float((shape.param_count() + shape.vocab * shape.hidden) * (call.row_bytes // shape.hidden))


KIND = ConditionKind(
    name="zero-inference",
    summary="DeepSpeed ZeRO-Inference: ZeRO-3 parameters in host memory, gathered layer by layer with prefetch",
    params={"mode": MODE_PARAM},  # DeepSpeed's ZeRO-Inference settings: engine/zero_inference.py ds_config
    h2d_bytes=h2d_bytes,
    since=7,
    competitor=Competitor(library=lambda params: LIBRARY, fastest_mode=lambda params: "eager",
                          capture_refusal=lambda params: CAPTURE_REFUSAL, extra=EXTRA),
)
