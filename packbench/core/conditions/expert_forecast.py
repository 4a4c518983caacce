"""`expert-forecast`: the next MoE layer's router applied to the current hidden state, its experts
prefetched on a side stream, then the exact demand completed. MoE models only."""

from typing import Any, Mapping

from packbench.core.conditions.base import CallInputs, ConditionKind


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    # Never an OPT model's (refused there); an MoE plan estimates through core/moe.py call_bytes.
    return call.packet()


KIND = ConditionKind(
    name="expert-forecast",
    summary="MoE only: the next MoE layer's experts forecast by its router and prefetched, then the exact demand completed",
    params={},
    h2d_bytes=h2d_bytes,
    # at least in one-token calls (wrong forecasts add); a longer call's tokens may share experts,
    # so it can move less than the estimate (core/moe.py call_bytes_bound)
    bound="about",
    families=("moe",),
)
