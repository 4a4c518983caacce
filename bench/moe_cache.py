"""The short table of bench/moe_cache_device.sh: for the newest screen archive under a
directory, per condition (scored finished episodes): decode ms per token (the median decode
call), host-to-device MB per decode token, the measured hit rate beside Belady's for the same
capacity (all calls / decode calls), the decode ready rate ((hits + used prefetches) / routed),
and the forecast's used / wasted experts
(core/report.py expert_cache_rows; docs/metrics.md).

Usage:  python -m bench.moe_cache ARCHIVE_DIR
"""

import statistics
import sys
from pathlib import Path

from packbench.core.report import expert_cache_rows, read_screen


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def table(archive: Path) -> str:
    screen = read_screen(archive)
    cache = {r["condition"]: r for r in expert_cache_rows(screen)}
    head = (f"{'condition':<22} {'tier':<6} {'decode ms/tok':>13} {'MB/tok':>9} {'hit/Belady (all)':>17} "
            f"{'hit/Belady (decode)':>20} {'ready (decode)':>14} {'used/wasted':>12}")
    lines = [f"{archive.name}: {screen.protocol.name}", head]
    for c in screen.protocol.conditions:
        eps = [e for e in screen.episodes if e.condition == c.name and e.scored and e.ok]
        decode = [call["wall_s"] for e in eps for call in e.calls if call["phase"] == "decode"]
        mb = [call["h2d_weight_bytes"] and sum(call["h2d_weight_bytes"]) + sum(call["h2d_index_bytes"])
              for e in eps for call in e.calls if call["phase"] == "decode"]
        r = cache.get(c.name)
        lines.append(f"{c.name:<22} {c.tier:<6} "
                     f"{(statistics.median(decode) * 1e3 if decode else float('nan')):13.3f} "
                     f"{(statistics.mean(mb) / 1e6 if mb else float('nan')):9.3f} "
                     + (f"{_pct(r['hit_rate']) + ' / ' + _pct(r['belady_rate']):>17} "
                        f"{_pct(r['decode_hit_rate']) + ' / ' + _pct(r['decode_belady_rate']):>20} "
                        f"{_pct(r['decode_ready_rate']):>14} "
                        f"{str(r['used']) + '/' + str(r['wasted']):>12}" if r
                        else f"{'-':>17} {'-':>20} {'-':>14} {'-':>12}"))
    return "\n".join(lines)


def main() -> None:
    root = Path(sys.argv[1])
    archives = sorted(root.rglob("*.zip"), key=lambda p: p.stat().st_mtime)
    if not archives:
        sys.exit(f"no archive under {root}; run the screen first")
    print(table(archives[-1]))


if __name__ == "__main__":
    main()
