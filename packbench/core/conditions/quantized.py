"""`quantized`: a low-bit model resident on the device (a competitor, tier approximate); its
runtime is engine/conditions/quantized.py over engine/quantized.py."""

from typing import Any, Mapping

from packbench.core.conditions.base import MODE_PARAM, ChoiceParam, Competitor, ConditionKind, nothing_moves

# Low-bit methods and the library each needs (engine/quantized.py).
QUANT_METHODS: dict[str, str] = {
    "int8-weight-only": "torchao",
    "int4-weight-only": "torchao",
    "nf4": "bitsandbytes",
    "llm-int8": "bitsandbytes",
}

# Why a method's calls cannot be captured (a mode other than eager is refused for it). A method
# missing here captures.
CAPTURE_REFUSALS: dict[str, str] = {
    # llm-int8 splits outlier columns by a threshold each call, a decision whose shapes depend on
    # the data. nf4 launches its kernels on shapes alone and is captured like torchao's int8, in
    # mode compile (mode graph failed on the H200: STACK_REFUSALS).
    "llm-int8": "bitsandbytes' llm-int8 splits outlier columns by a threshold on every call (data-dependent shapes)",
}

# Modes a library supports in principle that failed on the H200 stack of docs/benchmarks.md (torch
# 2.11, transformers 5.17, torchao 0.18): a CUDA worker refuses such a condition at load, before any
# episode, and `protocol plan` says why. On the CPU nothing is captured, so nothing is refused there.
STACK_REFUSALS: dict[tuple[str, str], str] = {
    ("torchao", "graph"): "capturing transformers' OPT decode step over torchao int8 weights as one CUDA graph "
                          "failed on the H200 (cudaErrorStreamCaptureUnsupported inside the forward); mode compile, "
                          "torchao's fastest and its default, captures through torch.compile",
    ("bitsandbytes", "graph"): "capturing transformers' OPT decode step over bitsandbytes nf4 weights as one CUDA "
                               "graph failed on the H200 (cudaErrorStreamCaptureInvalidated, bench.competitor_probe); "
                               "mode compile captures the compiled step instead",
}

# The fastest mode each method was measured in on the H200 (calibrated synthetic OPT-2.7B fp16,
# decode ms/token through one screen, docs/experiments/competitors.md "Every low-bit method in each of its modes"):
# torchao int8 weight-only compile 2.45 (eager 24.77 in an earlier screen), int4 weight-only
# compile 2.59 against eager 49.01, bitsandbytes nf4 compile 3.04 against eager 21.81; llm-int8
# cannot be captured (CAPTURE_REFUSALS), so eager. What schema 6 writes for an omitted `mode` at
# batch 1; a protocol frozen before keeps the mode it wrote out.
FASTEST_MODE: dict[str, str] = {"int8-weight-only": "compile", "int4-weight-only": "compile", "nf4": "compile",
                                "llm-int8": "eager"}


def library(params: Mapping[str, Any]) -> str:
    return QUANT_METHODS[params["method"]]


KIND = ConditionKind(
    name="quantized",
    summary="a low-bit model resident on the GPU (torchao, bitsandbytes)",
    # No default: which low-bit format is the whole claim, so a protocol states it.
    params={"method": ChoiceParam(choices=tuple(QUANT_METHODS), default=None), "mode": MODE_PARAM},
    h2d_bytes=nothing_moves,  # its quantized weights were placed once at start
    tier="approximate",
    since=5,
    competitor=Competitor(
        library=library,
        fastest_mode=lambda params: FASTEST_MODE[params["method"]],
        capture_refusal=lambda params: CAPTURE_REFUSALS.get(params.get("method", "")),
        stack_refusal=lambda params, mode: STACK_REFUSALS.get((library(params), mode)),
    ),
)
