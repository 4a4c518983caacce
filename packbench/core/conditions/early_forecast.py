"""`early-forecast`: rows predicted from the previous call prefetched, then the exact demand completed."""

from typing import Any, Mapping

from packbench.core.conditions.base import GATHER_PARAM, CallInputs, ConditionKind


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    return call.packet()  # at least packet's: the exact demand; wrong forecasts add waste


KIND = ConditionKind(
    name="early-forecast",
    summary="prefetch rows forecast from the previous call, then complete the exact demand",
    # Added after schemas 1-3 froze early-forecast without params: host in every schema.
    params={"gather": GATHER_PARAM},
    h2d_bytes=h2d_bytes,
    bound="at least",
)
