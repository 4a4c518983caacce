"""`expert-cache`: c experts per MoE layer kept on the GPU (LRU or LFU), misses fetched in the
call's packet, optionally with the next MoE layer's experts forecast and prefetched. MoE models only."""

from typing import Any, Mapping

from packbench.core.conditions.base import CallInputs, ChoiceParam, ConditionKind, IntParam
from packbench.core.expert_cache import CACHE_RULES


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    # Never an OPT model's (refused there); an MoE plan estimates through core/moe.py call_bytes.
    return call.packet()


KIND = ConditionKind(
    name="expert-cache",
    summary="MoE only: c experts a layer cached on the GPU (LRU or LFU), misses fetched; forecast on adds expert-forecast",
    # No default capacity: a cache size is a claim about the GPU, so a protocol states it (0 to
    # the model's experts; the allowance must hold c x layers experts, core/moe.py moe_refusal).
    params={"capacity": IntParam(minimum=0), "rule": ChoiceParam(choices=CACHE_RULES, default="lru"),
            "forecast": ChoiceParam(choices=("off", "on"), default="off")},
    h2d_bytes=h2d_bytes,
    bound="at most",
    families=("moe",),
)
