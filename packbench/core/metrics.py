"""Episode metrics derived from the per-call ledger. The worker and the auditor both use this,
so a stored total that disagrees with its own ledger is caught on audit.

A call ledger (engine.ledger.CallLedger.to_dict()) holds, per call: index, phase, tokens,
layers, the per-layer lists active_rows, rows_copied, h2d_weight_bytes, h2d_index_bytes,
d2h_bytes (and, from newer engines, rows_wasted and copy_wait_s), then logits_d2h_bytes and
wall_s. Sums run left to right in call and layer order, exactly as the worker summed them, so
float totals recompute bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

CALL_PHASES = ("prefill", "decode")
INT_LISTS = ("rows_copied", "h2d_weight_bytes", "h2d_index_bytes", "d2h_bytes")
OPTIONAL_INT_LISTS = ("rows_wasted",)
OPTIONAL_FLOAT_LISTS = ("copy_wait_s",)


def episode_totals(calls: list[dict]) -> dict:
    """Totals and per-phase aggregates of an episode's call ledgers.

    Always: h2d_weight_bytes, h2d_index_bytes, d2h_bytes (activity readbacks), call_s,
    logits_d2h_bytes (recording readbacks), rows_copied, and phases.{prefill,decode}.{calls,
    h2d_bytes, call_s}. rows_wasted and copy_wait_s when the ledger carries them.
    """
    totals: dict[str, Any] = {
        "h2d_weight_bytes": 0, "h2d_index_bytes": 0, "d2h_bytes": 0, "call_s": 0.0,
        "logits_d2h_bytes": 0, "rows_copied": 0,
        "phases": {ph: {"calls": 0, "h2d_bytes": 0, "call_s": 0.0} for ph in CALL_PHASES},
    }
    optional = [k for k in OPTIONAL_INT_LISTS + OPTIONAL_FLOAT_LISTS if any(k in c for c in calls)]
    for key in optional:
        totals[key] = 0 if key in OPTIONAL_INT_LISTS else 0.0
    for call in calls:
        w, i = sum(call["h2d_weight_bytes"]), sum(call["h2d_index_bytes"])
        totals["h2d_weight_bytes"] += w
        totals["h2d_index_bytes"] += i
        totals["d2h_bytes"] += sum(call["d2h_bytes"])
        totals["call_s"] += call["wall_s"]
        totals["logits_d2h_bytes"] += call["logits_d2h_bytes"]
        totals["rows_copied"] += sum(call["rows_copied"])
        for key in optional:
            totals[key] += sum(call.get(key, ()))
        phase = totals["phases"][call["phase"]]
        phase["calls"] += 1
        phase["h2d_bytes"] += w + i
        phase["call_s"] += call["wall_s"]
    return totals


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


# The per-value checks run over every per-layer value of every call (32 layers x 7 lists x
# thousands of calls): written with C-level builtins (map, set, min), they took a worst-case
# ledger (8192 calls x 32 layers) from 6.5 s to ~0.3 s per record on the 2-core box.
_NONE = type(None)


def _counts_ok(values: list, allow_none: bool) -> bool:
    """Integers >= 0 (bools are not), or None where allowed."""
    kinds = set(map(type, values))
    if allow_none and _NONE in kinds:
        kinds.discard(_NONE)
        values = [v for v in values if v is not None]
    return kinds <= {int} and (not values or min(values) >= 0)


def _times_ok(values: list) -> bool:
    """Finite numbers >= 0 (bools are not)."""
    return (set(map(type, values)) <= {int, float} and all(map(math.isfinite, values))
            and (not values or min(values) >= 0))


def ledger_problems(calls: Any) -> list[str]:
    """Why `calls` is not a well-formed ledger ([] when it is): episode_totals may then run.

    Checked: a list of mappings; phase prefill|decode; tokens and layers integers >= 1; every
    per-layer list of length `layers` holding integers >= 0 (active_rows may hold None; times
    finite >= 0); logits_d2h_bytes an integer >= 0; wall_s a finite time >= 0.
    """
    if not isinstance(calls, list):
        return ["calls is not a list"]
    out: list[str] = []
    for n, call in enumerate(calls):
        where = f"call {n}"
        if not isinstance(call, dict):
            out.append(f"{where} is not a mapping")
            continue
        if call.get("phase") not in CALL_PHASES:
            out.append(f"{where} phase {call.get('phase')!r} is not prefill or decode")
        for key in ("tokens", "layers"):
            if not _is_int(call.get(key)) or call[key] < 1:
                out.append(f"{where} {key} {call.get(key)!r} is not an integer >= 1")
        layers = call.get("layers") if _is_int(call.get("layers")) else None
        for key in INT_LISTS + ("active_rows",) + OPTIONAL_INT_LISTS + OPTIONAL_FLOAT_LISTS:
            if key not in call and key in OPTIONAL_INT_LISTS + OPTIONAL_FLOAT_LISTS:
                continue
            values = call.get(key)
            if not isinstance(values, list) or (layers is not None and len(values) != layers):
                out.append(f"{where} {key} is not a list of {layers} per-layer values")
                continue
            ok = _times_ok(values) if key in OPTIONAL_FLOAT_LISTS else _counts_ok(values, key == "active_rows")
            if not ok:
                out.append(f"{where} {key} holds a value that is not a count >= 0")
        if not _is_int(call.get("logits_d2h_bytes")) or call["logits_d2h_bytes"] < 0:
            out.append(f"{where} logits_d2h_bytes {call.get('logits_d2h_bytes')!r} is not an integer >= 0")
        if not _is_time(call.get("wall_s")):
            out.append(f"{where} wall_s {call.get('wall_s')!r} is not a finite time >= 0")
    return out


def stored_total_problems(record: dict, totals: dict) -> list[str]:
    """Stored totals of `record` that differ from `totals` (recomputed from its ledger).

    Only totals the record stores are compared (an older engine stored fewer; the gates fail
    closed on what is missing); phase entries the ledger cannot give (wall_s) are not compared.
    Integers and floats compare exactly: the worker summed in the same order.
    """
    out = []
    for key, value in totals.items():
        if key == "phases":
            stored = record.get("phases")
            if stored is None:
                continue
            if not isinstance(stored, dict):
                out.append(f"stored phases {stored!r} is not a mapping")
                continue
            for ph, agg in value.items():
                mine = stored.get(ph)
                if not isinstance(mine, dict):
                    out.append(f"stored phases.{ph} is missing or not a mapping")
                    continue
                for k, v in agg.items():
                    if k in mine and not _same(mine[k], v):
                        out.append(f"stored phases.{ph}.{k} {mine[k]!r} != {v!r} recomputed from the call ledger")
        elif key in record and not _same(record[key], value):
            out.append(f"stored {key} {record[key]!r} != {value!r} recomputed from the call ledger")
    return out


def _same(a: Any, b: Any) -> bool:
    """Exactly equal and of the same JSON type (an integer total stored as 1.0 is a difference)."""
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- physical invariants

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def opt_bytes(*, hidden: int, ffn: int, layers: int, vocab: int, max_positions: int, dtype: str, **_: int) -> dict:
    """Bytes of a pre-LayerNorm OPT with tied embeddings (the synthetic checkpoints' shape), as
    the CPU-first start record counts them: every parameter; the outgoing fc2 weights that stay
    on the host; the rest on the device; one outgoing row (`hidden` values)."""
    size = DTYPE_BYTES[dtype]
    per_layer = (4 * (hidden * hidden + hidden)  # q, k, v, out projections with biases
                 + 4 * hidden  # two LayerNorms
                 + hidden * ffn + ffn  # fc1
                 + ffn * hidden + hidden)  # fc2
    params = vocab * hidden + (max_positions + 2) * hidden + layers * per_layer + 2 * hidden
    host = layers * ffn * hidden * size
    return {"param_bytes": params * size, "host_outgoing_bytes": host, "device_param_bytes": params * size - host,
            "row_bytes": hidden * size}


def row_bytes_problems(calls: list[dict], row_bytes: int | None) -> tuple[list[str], int | None]:
    """Every layer of every call must move h2d_weight_bytes == rows_copied x row_bytes (one outgoing
    row is `hidden` values of the model's dtype). With `row_bytes` None (a checkpoint whose shape
    the archive does not state) the first layer that copied a row fixes it for the rest.
    Returns (problems, the row bytes used). Needs a well-formed ledger (ledger_problems == [])."""
    out: list[str] = []
    for n, call in enumerate(calls):
        for layer, (w, rows) in enumerate(zip(call["h2d_weight_bytes"], call["rows_copied"])):
            if row_bytes is None and rows:
                row_bytes = w // rows if w % rows == 0 else -1
            if (row_bytes is None and w) or (row_bytes is not None and w != rows * row_bytes):
                out.append(f"call {n} layer {layer} moved {w} weight bytes for {rows} rows"
                           + (f" of {row_bytes} B" if row_bytes and row_bytes > 0 else ""))
                if len(out) >= 3:
                    return out, row_bytes
    return out, row_bytes


def wall_problems(record: dict, totals: dict) -> list[str]:
    """An episode cannot take less wall time than its own forward calls."""
    wall = record.get("wall_s")
    if _is_time(wall) and wall < totals["call_s"]:
        return [f"wall_s {wall!r} is below the {totals['call_s']!r} s its calls took"]
    return []
