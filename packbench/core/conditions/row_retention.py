"""`row-retention`: a GPU LRU cache of outgoing rows; only cache misses are copied."""

from typing import Any, Mapping

from packbench.core.conditions.base import CallInputs, ConditionKind, IntParam


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    return call.packet()  # at most packet's: only misses move (the hit rate is not modelled)


KIND = ConditionKind(
    name="row-retention",
    summary="GPU LRU cache of rows, copy misses only",
    # No default: a cache size is a claim about the GPU, so a protocol states it.
    params={"rows_per_layer": IntParam(minimum=1)},
    h2d_bytes=h2d_bytes,
    bound="at most",
)
