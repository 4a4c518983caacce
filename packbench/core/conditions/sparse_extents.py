"""`sparse-extents`: fixed-size row blocks that hold any active row, copied every call."""

import math
from typing import Any, Mapping

from packbench.core.conditions.base import INDEX_BYTES, CallInputs, ConditionKind, IntParam


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    """blocks x (B x row + 8) a layer: every B-row block holding an active row (neurons
    independent), never more than the dense copy plus the block indices."""
    b, shape = params["block_rows"], call.shape
    blocks = math.ceil(shape.ffn / b) * call.activity.block_fraction(call.tokens, b)
    per_layer = min(blocks * (b * call.row_bytes + INDEX_BYTES), shape.ffn * call.row_bytes + blocks * INDEX_BYTES)
    return per_layer * shape.layers


KIND = ConditionKind(
    name="sparse-extents",
    summary="copy the fixed-size row blocks that hold any active row",
    params={"block_rows": IntParam(minimum=1, default=128)},
    h2d_bytes=h2d_bytes,
)
