"""Machine-readable and table views of a screen, built from the database."""

import json
import re

from packbench.core.text import one_line


def screen_summary(store, ref: str | int) -> dict:
    """Screen id, archive path, verdicts and episodes of a screen's latest attempt."""
    screen = store.screen(ref)
    attempt = store.latest_attempt(screen.id)
    protocol = store.protocol(screen.protocol_id)
    out = {"screen_id": screen.id, "status": screen.status, "protocol": protocol.name,
           "protocol_sha256": protocol.sha256, "attempt": None, "archive_path": None, "archive_sha256": None,
           "error": None, "audit": None, "verdicts": [], "episodes": [], "spread": []}
    if attempt is None:
        return out
    out.update(attempt=attempt.number, archive_path=attempt.archive_path, archive_sha256=attempt.archive_sha256,
               error=attempt.error)
    tiers = store.condition_tiers([protocol.sha256]).get(protocol.sha256, {})
    out["verdicts"] = [{**verdict_record(v), "tier": tiers.get(v.condition)} for v in store.verdicts(attempt.id)]
    audits = store.audits(attempt.id)
    # Whether the screen was audited, where and with what result (the latest audit of this attempt).
    out["audit"] = None if not audits else {
        "result": audits[-1].result, "digest": audits[-1].digest, "kind": audits[-1].kind,
        "machine": audits[-1].machine, "node": audits[-1].node, "finished_at": str(audits[-1].finished_at),
        "audits": len(audits),
        # None: an attempt that did not finish never stored its archive's SHA-256, or the audit never
        # hashed the archive (over the size bound: `archive_hashed` false), so there is nothing to match.
        "archive_sha256_matches": None if attempt.archive_sha256 is None or audits[-1].archive_sha256 is None
        else audits[-1].archive_sha256 == attempt.archive_sha256,
        "archive_hashed": audits[-1].archive_sha256 is not None}
    # `recording: false` ran without the per-call ledger: its byte counts are zeros that measured
    # nothing, shown as not recorded (null, "-") rather than as transfers of 0 bytes.
    recorded = json.loads(protocol.canonical_json).get("recording", True) is not False
    out["episodes"] = [{"index": e.plan_index, "condition": e.condition, "tier": tiers.get(e.condition),
                        "role": e.role, "prompt": e.prompt, "status": e.status, "tokens": list(e.tokens),
                        "h2d_bytes": e.h2d_weight_bytes + e.h2d_index_bytes if recorded else None,
                        "d2h_bytes": e.d2h_bytes if recorded else None,
                        "wall_s": e.wall_s,
                        **({f: getattr(e, f) for f in FIDELITY_FIELDS} if e.fidelity_mean_kl is not None else {}),
                        **({"error": e.error} if e.status != "ok" else {})}  # why, without opening the archive
                       for e in store.episodes(attempt.id)]
    out["spread"] = condition_spread(out["episodes"])
    out["fidelity_caveat"] = fidelity_caveat(json.loads(protocol.canonical_json).get("model", {}).get("synth"),
                                             out["verdicts"])
    return out


def fidelity_caveat(synth: dict | None, verdicts: list[dict]) -> str | None:
    """The line a screen's fidelity verdicts carry when they were judged on a synthetic checkpoint
    whose response to quantization is not calibrated to real OPT's (core.registry.robustness_caveat);
    None for a real checkpoint, a calibrated one, or a screen without a fidelity verdict."""
    from packbench.core.registry import robustness_caveat

    if synth is None or not any(v.get("gate") == "fidelity" for v in verdicts):
        return None
    return robustness_caveat(synth)


def condition_spread(episodes: list[dict]) -> list[dict]:
    """Per condition (plan order): n, median, p10, p90 and p90/p10 of its scored ok episodes'
    walls (core/dispersion.py spread): a wall read beside its spread, not alone."""
    from packbench.core.dispersion import spread

    out = []
    for condition in dict.fromkeys(e["condition"] for e in episodes):
        walls = [e["wall_s"] for e in episodes if e["condition"] == condition and e["role"] == "scored"
                 and e["status"] == "ok" and e["wall_s"] is not None]
        tier = next(e["tier"] for e in episodes if e["condition"] == condition)
        out.append({"condition": condition, "tier": tier, **spread(walls)})
    return out


FIDELITY_FIELDS = ("fidelity_mean_kl", "fidelity_p99_kl", "fidelity_top1", "fidelity_max_abs_logit",
                   "fidelity_divergence_step")


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return one_line(str(value))  # a name from a protocol or archive may hold a newline or a bidi override


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


ALLOWANCE_GATES = ("resources", "capacity")  # their value and threshold are bytes against the allowance


def _mib(value):
    """Bytes as the protocol writes the allowance (`allowance_mib: 512` -> `512 MiB`)."""
    return None if value is None else f"{value / (1 << 20):.6g} MiB"


# How each gate compares what it judged with its threshold: capacity passes when the parameters
# exceed the allowance (the start was CPU-first); every other gate when it stays at or under,
# except fidelity, whose detail says which way its first threshold bounds (`(bound >= 0.98)`).
PASSES_WHEN = {"capacity": ">"}
_BOUND = re.compile(r"\(bound (<=|>=) ")


def _passes_when(v: dict) -> str:
    if v.get("gate") == "fidelity":
        m = _BOUND.search(v.get("detail") or "")
        return m.group(1) if m else "<="
    return PASSES_WHEN.get(v.get("gate"), "<=")


def verdict_record(v) -> dict:
    """A stored verdict (db StoredVerdict) as JSON: what it was judged on included (interval, detail)."""
    lo, hi = v.interval if v.interval is not None else (None, None)
    return {"gate": v.gate, "condition": v.condition, "phase": v.phase, "passed": v.passed, "value": v.value,
            "threshold": v.threshold, "interval_lo": lo, "interval_hi": hi, "detail": v.detail}


def _interval(v: dict) -> tuple[float, float] | None:
    """(lo, hi) of a verdict in either form: the gates' `interval` list or stored interval_lo/hi."""
    i = v.get("interval")
    if i:
        return float(i[0]), float(i[1])
    if v.get("interval_lo") is not None and v.get("interval_hi") is not None:
        return float(v["interval_lo"]), float(v["interval_hi"])
    return None


_LONG_FLOAT = re.compile(r"(?<![\w.])\d+\.\d{5,}(?:e[-+]?\d+)?")


def detail_text(detail: str | None) -> str:
    """A verdict's detail for reading: long floats to 4 significant digits (`149.35989795600017 s`
    -> `149.4 s`) and `1 episodes` as `1 episode`. The stored detail, which audits compare, is
    never changed."""
    if not detail:
        return ""
    text = _LONG_FLOAT.sub(lambda m: f"{float(m.group()):.4g}", detail)
    return re.sub(r"(?<![\d.])1 episodes\b", "1 episode", text)


def _g(x: float) -> str:
    return f"{x:.4g}"


def decided_by(v: dict) -> str:
    """What the verdict was decided on, and how it compared: `upper bound 2.493 > 1` for a gate
    that judges an interval (runtime: the bootstrap interval's upper bound), else `value`."""
    interval, t = _interval(v), v.get("threshold")
    if v.get("value") is None:
        return "fail closed (no value)"
    if interval is None or t is None:
        return "value" if v.get("gate") != "useful_latency" else "value and cold start"
    hi = interval[1]
    return f"upper bound {_g(hi)} {'<=' if v.get('passed') else '>'} {_g(t)}"


def verdict_table(verdicts: list[dict], *, lead: tuple[str, ...] = (), caveat: str | None = None) -> str:
    """Verdicts with what each was judged on: value, interval (where the gate judges one), the
    threshold with its comparison, and the bound that decided. A FAIL's detail follows the table."""
    rows = []
    for v in verdicts:
        interval = _interval(v)
        allowance = v.get("gate") in ALLOWANCE_GATES
        t = v.get("threshold")
        threshold = None if t is None else f"{_passes_when(v)} {_mib(t) if allowance else _g(t)}"
        rows.append({**v, "passed": "PASS" if v["passed"] else "FAIL",
                     "value": _mib(v.get("value")) if allowance else v.get("value"),
                     "interval": None if interval is None else f"[{_g(interval[0])}, {_g(interval[1])}]",
                     "threshold": threshold, "decided by": decided_by(v)})
    tier = ["tier"] if any(v.get("tier") for v in verdicts) else []  # exact or approximate, where known
    out = table(rows, [*lead, "gate", "condition", *tier, "phase", "passed", "value", "interval", "threshold",
                       "decided by"])
    why = [f"  {''.join(f'{k} {v[k]} ' for k in lead)}{v['gate']} {v['condition']} {v.get('phase', 'all')}: "
           f"{detail_text(v['detail'])}" for v in verdicts
           if not v["passed"] and v.get("detail")]
    return "\n".join([out, *(["FAIL detail:"] + why if why else []), *([f"fidelity: {caveat}"] if caveat else [])])


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))
