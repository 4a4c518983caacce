"""`row-retention`: a GPU LRU cache of outgoing rows; only cache misses are copied."""

from typing import Any, Mapping

from packbench.core.conditions.base import INDEX_BYTES, CallInputs, ConditionKind, IntParam


def h2d_bytes(params: Mapping[str, Any], call: CallInputs) -> float:
    """At most packet's plus the fills' slot indices: only misses move with their index, a hit
    costs two indices (16 B, less than the row and index it saves), and up to rows_per_layer
    missed rows are written into the cache by one more index each (core/charges.py). A cold
    call (the prefill) hits nothing, so it moves packet's bytes and those fill indices. The hit
    rate is not modelled."""
    fills = min(call.active(), params["rows_per_layer"])
    return call.packet() + fills * INDEX_BYTES * call.shape.layers


KIND = ConditionKind(
    name="row-retention",
    summary="GPU LRU cache of rows, copy misses only",
    # No default: a cache size is a claim about the GPU, so a protocol states it.
    params={"rows_per_layer": IntParam(minimum=1)},
    h2d_bytes=h2d_bytes,
    bound="at most",
)
