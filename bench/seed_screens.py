"""What the seed's v0.40 / v0.42 screens conclude on this database (bench/workloads_device.sh):
per screen, each condition's scored episodes (median wall, summed H2D bytes) and the two
comparisons the seed's v0.42 made: phase-switched against always-packet and against dense-stream."""

import statistics

from packbench.db.store import Store


def main() -> None:
    store = Store()
    for screen in store.list_screens():
        attempt = store.latest_attempt(screen.id)
        if attempt is None:
            continue
        eps = [e for e in store.episodes(attempt.id) if e.role == "scored" and e.status == "ok"]
        wall = {c: statistics.median(e.wall_s for e in eps if e.condition == c) for c in {e.condition for e in eps}}
        h2d = {c: sum(e.h2d_weight_bytes + e.h2d_index_bytes for e in eps if e.condition == c) for c in wall}
        print(f"screen {screen.id} {screen.protocol}: {attempt.status}")
        for c in sorted(wall):
            print(f"  {c:15} median episode wall {wall[c]:.4f} s, H2D {h2d[c]:,} B")
        for a, b in (("phase-switched", "packet"), ("phase-switched", "dense-stream"), ("packet", "dense-stream")):
            if a in wall and b in wall:
                print(f"  {a} vs {b}: {h2d[a] / h2d[b] - 1:+.2%} bytes, {wall[a] / wall[b] - 1:+.2%} episode wall")
        verdicts = [f"{v.gate} {v.condition} {v.phase} {'PASS' if v.passed else 'FAIL'}"
                    for v in store.verdicts(attempt.id) if v.gate in ("runtime", "acquisition")]
        print("  " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
