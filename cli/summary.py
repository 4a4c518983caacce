"""Machine-readable and table views of a screen, built from the database."""

import json

from core.text import one_line


def screen_summary(store, ref: str | int) -> dict:
    """Screen id, archive path, verdicts and episodes of a screen's latest attempt."""
    screen = store.screen(ref)
    attempt = store.latest_attempt(screen.id)
    protocol = store.protocol(screen.protocol_id)
    out = {"screen_id": screen.id, "status": screen.status, "protocol": protocol.name,
           "protocol_sha256": protocol.sha256, "attempt": None, "archive_path": None, "archive_sha256": None,
           "error": None, "audit": None, "verdicts": [], "episodes": []}
    if attempt is None:
        return out
    out.update(attempt=attempt.number, archive_path=attempt.archive_path, archive_sha256=attempt.archive_sha256,
               error=attempt.error)
    out["verdicts"] = [{"gate": v.gate, "condition": v.condition, "phase": v.phase, "passed": v.passed,
                        "value": v.value, "threshold": v.threshold} for v in store.verdicts(attempt.id)]
    audits = store.audits(attempt.id)
    # Whether the screen was audited, where and with what result (the latest audit of this attempt).
    out["audit"] = None if not audits else {
        "result": audits[-1].result, "digest": audits[-1].digest, "kind": audits[-1].kind,
        "machine": audits[-1].machine, "node": audits[-1].node, "finished_at": str(audits[-1].finished_at),
        "audits": len(audits), "archive_sha256_matches": audits[-1].archive_sha256 == attempt.archive_sha256}
    out["episodes"] = [{"index": e.plan_index, "condition": e.condition, "role": e.role, "prompt": e.prompt,
                        "status": e.status, "tokens": list(e.tokens),
                        "h2d_bytes": e.h2d_weight_bytes + e.h2d_index_bytes, "d2h_bytes": e.d2h_bytes,
                        "wall_s": e.wall_s} for e in store.episodes(attempt.id)]
    return out


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


def verdict_table(verdicts: list[dict]) -> str:
    rows = [{**v, "passed": "PASS" if v["passed"] else "FAIL",
             **({"value": _mib(v.get("value")), "threshold": _mib(v.get("threshold"))}
                if v.get("gate") in ALLOWANCE_GATES else {})} for v in verdicts]
    return table(rows, ["gate", "condition", "phase", "passed", "value", "threshold"])


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))
