"""`packet`: the exact active rows of each call and their indices, in one transfer a layer."""

from typing import Any, Mapping

from packbench.core.conditions.base import PACKET_GATHER_PARAM, WEIGHTS_PARAM, CallInputs, ConditionKind


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    return call.packet()  # k x (row + 8) a layer: k active rows and their int64 indices


KIND = ConditionKind(
    name="packet",
    summary="exact active rows, gathered on the host or by the device",
    # `packet` without params froze as gather host (schemas 1 and 2): this default may never move.
    params={"gather": PACKET_GATHER_PARAM, "weights": WEIGHTS_PARAM},
    h2d_bytes=h2d_bytes,
    # Schema 3: the device gather is the fast exact mechanism; the host gather (the seed's v0.40
    # mechanism) stays available as `gather: host`.
    schema_defaults={3: {"gather": "device"}},
    families=("opt", "moe"),  # an MoE model runs it at expert granularity (engine/moe/policies.py)
)
