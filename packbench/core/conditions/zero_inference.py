"""`zero-inference`: DeepSpeed ZeRO-Inference, ZeRO stage 3 with every parameter offloaded to host
memory and gathered onto the device layer by layer with DeepSpeed's own prefetching (a competitor;
stock transformers' modules, so tier exact, judged for faithfulness); its runtime is
engine/conditions/zero_inference.py over engine/zero_inference.py."""

from typing import Any, Mapping

from packbench.core.conditions.base import MODE_PARAM, CallInputs, Competitor, ConditionKind

LIBRARY = "deepspeed"
EXTRA = "offload"  # pyproject.toml's [offload] extra brings it
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
