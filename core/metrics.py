"""Episode metrics derived from the per-call ledger. The worker and the auditor both use this,
so a stored total that disagrees with its own ledger is caught on audit.
"""


def episode_totals(calls: list[dict]) -> dict:
    """Totals and per-phase aggregates of an episode's call ledgers (CallLedger.to_dict() form)."""
    totals = {"h2d_weight_bytes": 0, "h2d_index_bytes": 0, "d2h_bytes": 0, "call_s": 0.0,
              "phases": {ph: {"calls": 0, "h2d_bytes": 0, "call_s": 0.0} for ph in ("prefill", "decode")}}
    for call in calls:
        w, i = sum(call["h2d_weight_bytes"]), sum(call["h2d_index_bytes"])
        totals["h2d_weight_bytes"] += w
        totals["h2d_index_bytes"] += i
        totals["d2h_bytes"] += sum(call["d2h_bytes"])
        totals["call_s"] += call["wall_s"]
        phase = totals["phases"][call["phase"]]
        phase["calls"] += 1
        phase["h2d_bytes"] += w + i
        phase["call_s"] += call["wall_s"]
    return totals
