"""The MoE competitors' screen, as its users ask for it: per condition, the cold episode (its first
of the screen, the protocol's warm-up: build, first kernels, first pinned pages) apart from the warm
ones (scored), TTFT (the prefill call) apart from decode (ms per token, decode tokens/s), bytes per
decode token in each direction, experts routed per layer, tier and the verdict of the gate that
judges it (faithfulness for an exact condition, fidelity for an approximate one).

  python -m bench.moe_peers_screen ARCHIVE.zip

Reads a sealed archive (audit it first: `packbench audit`); prints one table. Figures are medians
over the episodes of a row (docs/metrics.md's serving figures, core/serving.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import zipfile
from pathlib import Path

from packbench.core.serving import episode_serving


def episodes(path: Path) -> tuple[list[dict], list[dict]]:
    """(episode records in plan order, verdicts) of an archive; an archive sealed without verdicts
    (a screen that failed before its gates) gives no verdicts, and its episodes still print."""
    with zipfile.ZipFile(path) as z:
        names = sorted(n for n in z.namelist() if n.startswith("episodes/") and n.endswith(".json"))
        records = [json.loads(z.read(n)) for n in names]
        verdicts = json.loads(z.read("verdicts.json")) if "verdicts.json" in z.namelist() else []
    return records, verdicts


def per_token(record: dict, key: str) -> float:
    """Mean bytes per decode token of ledger field `key` (a per-layer list), every decode call."""
    calls = [c for c in record["calls"] if c["phase"] == "decode"]
    tokens = sum(c["tokens"] for c in calls)
    return sum(sum(c[key]) for c in calls) / tokens if tokens else 0.0


def rows(records: list[dict], verdicts: list[dict]) -> list[dict]:
    """One row per (condition, cold|warm): medians of its episodes' figures. Pure."""
    judged = {}
    for v in verdicts:
        if v["gate"] in ("faithfulness", "fidelity") and v.get("phase", "all") == "all":
            judged[v["condition"]] = f"{v['gate']} {'PASS' if v['passed'] else 'FAIL'}"
    out = []
    for name in dict.fromkeys(r["condition"] for r in records):
        mine = [r for r in records if r["condition"] == name]
        for state, group in (("cold", [r for r in mine if r["role"] == "warmup"]),
                             ("warm", [r for r in mine if r["role"] != "warmup"])):
            ok = [r for r in group if r["status"] == "ok"]
            if not group:
                continue
            if not ok:
                out.append({"condition": name, "state": state, "error": group[0].get("error")})
                continue
            serving = [episode_serving(r) for r in ok]
            routed = [a for r in ok for c in r["calls"] if c["phase"] == "decode" for a in c["active_rows"]
                      if a is not None]
            fid = [r["fidelity"] for r in ok if r.get("fidelity")]
            out.append({
                "condition": name, "state": state, "episodes": len(ok), "tier": ok[0]["tier"],
                "ttft_ms": 1e3 * statistics.median(s["ttft_s"] for s in serving),
                "decode_ms": 1e3 * statistics.median(statistics.median(s["itl_s"]) for s in serving),
                "tokens_per_s": statistics.median(s["decode_tokens_per_s"] for s in serving),
                "h2d_weight": statistics.median(per_token(r, "h2d_weight_bytes") for r in ok),
                "h2d_other": statistics.median(per_token(r, "h2d_index_bytes") for r in ok),
                "d2h": statistics.median(per_token(r, "d2h_bytes") for r in ok),
                "routed": statistics.mean(routed) if routed else None,
                "mean_kl": max(f["mean_kl"] for f in fid) if fid else None,
                "top1": min(f["top1"] for f in fid) if fid else None,
                "verdict": judged.get(name, "-") if state == "warm" else ""})
    return out


def table(out: list[dict]) -> str:
    head = (f"{'condition':<16} {'state':<5} {'n':>2} {'tier':<11} {'TTFT ms':>9} {'decode ms/tok':>13} "
            f"{'tok/s':>7} {'h2d MB/tok w+other':>19} {'d2h KB/tok':>10} {'experts/layer':>13} "
            f"{'worst KL':>9} {'top1':>5}  verdict")
    lines = [head]
    for r in out:
        if "error" in r:
            lines.append(f"{r['condition']:<16} {r['state']:<5} failed: {r['error']}")
            continue
        routed = "-" if r["routed"] is None else f"{r['routed']:.2f}"
        kl = "-" if r["mean_kl"] is None else f"{r['mean_kl']:.2e}"
        top1 = "-" if r["top1"] is None else f"{r['top1']:.3f}"
        moved = f"{r['h2d_weight'] / 1e6:.1f}+{r['h2d_other'] / 1e6:.2f}"
        lines.append(f"{r['condition']:<16} {r['state']:<5} {r['episodes']:2d} {r['tier']:<11} {r['ttft_ms']:9.1f} "
                     f"{r['decode_ms']:13.2f} {r['tokens_per_s']:7.2f} {moved:>19} {r['d2h'] / 1e3:10.2f} "
                     f"{routed:>13} {kl:>9} {top1:>5}  {r['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m bench.moe_peers_screen ARCHIVE.zip")
    records, verdicts = episodes(Path(args[0]))
    print(table(rows(records, verdicts)))


if __name__ == "__main__":
    main()
