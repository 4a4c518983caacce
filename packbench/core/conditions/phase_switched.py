"""`phase-switched`: dense-stream in prefill calls, exact packets in decode calls."""

from typing import Any, Mapping

from packbench.core.conditions.base import PACKET_GATHER_PARAM, CallInputs, ConditionKind


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    return call.dense() if call.phase == "prefill" else call.packet()


KIND = ConditionKind(
    name="phase-switched",
    summary="dense prefill calls, packet decode calls",
    # Added after schemas 1-3 froze phase-switched without params: host there.
    params={"gather": PACKET_GATHER_PARAM},
    h2d_bytes=h2d_bytes,
    # Schema 4 decodes with the device gather, as packet does since schema 3 (the host gather kept
    # it from mode graph's capture).
    schema_defaults={4: {"gather": "device"}},
    families=("opt", "moe"),  # an MoE model runs it at expert granularity (engine/moe/policies.py)
)
