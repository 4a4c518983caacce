"""What a loader policy charges to the ledger for one layer of one call: the one formula of each
policy's bytes, shared by the engine (engine/policies/, engine/moe/) and by `packbench simulate`
(core/simulate.py), so a simulated ledger cannot drift from the engine's.

Each function returns the keyword arguments of `Recorder.add` (engine/ledger.py): `active`
(units observed active), `rows` (units copied), `weight_bytes`, `index_bytes` (host-to-device),
`d2h_bytes` (readbacks) and `wasted` (units copied but not needed). A unit is an OPT outgoing
row or an MoE expert. The set arithmetic of the stateful policies (an LRU row cache, a forecast
from the previous call) is here too, on numpy arrays of sorted unit ids.

Layer rule: core. numpy only.
"""

from __future__ import annotations

import numpy as np

INDEX_BYTES = 8  # every index travels as int64 (index_copy_ wants int64 on every backend)
COUNT_BYTES = 4  # a device-side count read back after the call (int32)


def activity_readback(active: int, units: int) -> dict:
    """The host gathers' mask readback: one byte per unit of the layer (an OPT (ffn,) bool
    mask; an MoE layer's routing, one byte per expert)."""
    return dict(active=active, d2h_bytes=units)


def unit_packet(units: int, unit_bytes: int, *, index: int | None = None) -> dict:
    """One packet of `units` rows (or experts) of `unit_bytes` each and `index` int64 indices
    (default: one per unit; None: as many as units; 0: no index travels, the device gather)."""
    n = units if index is None else index
    return dict(rows=units, weight_bytes=units * unit_bytes, index_bytes=n * INDEX_BYTES)


def dense_copy(units: int, unit_bytes: int) -> dict:
    """Every unit of the layer, no index (dense-stream, phase-switched's prefill)."""
    return dict(rows=units, weight_bytes=units * unit_bytes)


def device_counts(active: int, unit_bytes: int, *, counters: int = 1, rows: int | None = None,
                  wasted: int = 0) -> dict:
    """A device gather's layer: `rows` (default `active`) copied with no index, and `counters`
    int32 counts read back once the call's logits are on the host."""
    k = active if rows is None else rows
    return dict(active=active, rows=k, weight_bytes=k * unit_bytes, d2h_bytes=counters * COUNT_BYTES, wasted=wasted)


def expert_prefetch(prefetched: int, unit_bytes: int, units: int) -> dict:
    """An expert forecast for the next layer (expert-cache {forecast: on}, expert-forecast): the
    next router's top-k union read back (one byte per expert), then the forecast experts the next
    layer's cache does not hold copied with no index; charged to the layer they are for."""
    return dict(rows=prefetched, weight_bytes=prefetched * unit_bytes, d2h_bytes=units)


def expert_fetch(fetched: int, unit_bytes: int, *, wasted: int = 0) -> dict:
    """An expert cache's layer once its routing is known: the misses no forecast brought copied
    with no index (the device gather), and the prefetched experts the call did not route
    (`wasted`). Hits move nothing."""
    return dict(rows=fetched, weight_bytes=fetched * unit_bytes, wasted=wasted)


def extent_blocks(active: np.ndarray, block_rows: int) -> np.ndarray:
    """Sorted ids of the `block_rows`-row blocks holding an active row (sparse-extents)."""
    return np.unique(np.asarray(active, dtype=np.int64) // block_rows)


def extent_rows(blocks: np.ndarray, block_rows: int, units: int) -> int:
    """Rows the blocks cover; the last block of a layer may be short."""
    blocks = np.asarray(blocks, dtype=np.int64)
    return int(np.minimum(block_rows, units - blocks * block_rows).sum())


def retention_hits(hits: int) -> dict:
    """row-retention's hits: served from the device cache by a slot and a row index each."""
    return dict(index_bytes=2 * hits * INDEX_BYTES)


def retention_fills(fills: int) -> dict:
    """row-retention's fills: the tail of the misses' packet written into cache slots by index."""
    return dict(index_bytes=fills * INDEX_BYTES)


def lru_plan(slot_of: np.ndarray, last_used: np.ndarray, active: np.ndarray, now: int):
    """One call of an LRU row cache, decided on host arrays (mutated in place).

    slot_of: (ffn,) cache slot of each neuron or -1; last_used: (slots,) last call a slot served;
    active: sorted neuron ids this call needs. Returns (hit_rows, hit_slots, miss_rows,
    fill_rows, fill_slots): hits are served from the cache, misses are copied, and the last
    `slots` misses are then written into the least recently used slots (hits of this call are
    evicted last, since their rows were already scattered into the workspace).
    """
    slots = last_used.shape[0]
    hit = slot_of[active] >= 0
    hit_rows, miss_rows = active[hit], active[~hit]
    hit_slots = slot_of[hit_rows]
    last_used[hit_slots] = now
    fill_rows = miss_rows[-slots:] if miss_rows.size > slots else miss_rows
    fill_slots = np.argsort(last_used, kind="stable")[: fill_rows.size]
    owner = np.full(slots, -1, dtype=np.int64)
    owner[slot_of[slot_of >= 0]] = np.nonzero(slot_of >= 0)[0]
    evicted = owner[fill_slots]
    slot_of[evicted[evicted >= 0]] = -1
    slot_of[fill_rows] = fill_slots
    last_used[fill_slots] = now
    return hit_rows, hit_slots, miss_rows, fill_rows, fill_slots


def forecast_split(predicted: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, int]:
    """(remainder, wasted): the active units the forecast missed, which must still be sent, and
    how many forecast units turned out inactive. Exactness never depends on the forecast: every
    active unit is either forecast or in the remainder."""
    hit = np.isin(active, predicted)
    return active[~hit], int(predicted.size - hit.sum())
