"""`dense-stream`: every outgoing weight copied every call (the usual reference)."""

from typing import Any, Mapping

from packbench.core.conditions.base import WEIGHTS_PARAM, CallInputs, ConditionKind


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    return call.dense()  # ffn x row a layer


KIND = ConditionKind(
    name="dense-stream",
    summary="copy every outgoing weight every call",
    params={"weights": WEIGHTS_PARAM},
    h2d_bytes=h2d_bytes,
    families=("opt", "moe"),  # an MoE model runs it at expert granularity (engine/moe/policies.py)
)
