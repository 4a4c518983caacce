"""`early-forecast`: rows predicted from the previous call prefetched, then the exact demand completed."""

from typing import Any, Mapping

from packbench.core.conditions.base import GATHER_PARAM, CallInputs, ConditionKind


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    # At least the exact demand: wrong forecasts add waste. The host gather sends each row with
    # its int64 index; the device gather sends no index, so its floor is the rows alone.
    return call.packet(index=params.get("gather", "host") == "host")


KIND = ConditionKind(
    name="early-forecast",
    summary="prefetch rows forecast from the previous call, then complete the exact demand",
    # Added after schemas 1-3 froze early-forecast without params: host in every schema.
    params={"gather": GATHER_PARAM},
    h2d_bytes=h2d_bytes,
    bound="at least",
)
