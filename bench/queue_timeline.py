"""Where a dispatch's wall goes, screen by screen (issue 13: concurrent vs one after the other).

    python -m bench.queue_timeline T0 SCREEN [SCREEN ...]

T0 is the Unix time the `packbench dispatch` process was started. For each screen's latest
attempt it prints, in seconds from T0: the dispatcher's registration (Ray is up), the worker's start
(Ray's process start to the actor, the engine import, the engine's init), the claim, the
worker's load (entry to loaded, of it the read), the episodes (warmups and scored, their own
walls summed) and the end; then each condition's median scored wall per screen (contention
shows as slower walls when screens run side by side), and its median worker time per episode
outside that wall (the policy's activation and the measurements). Reads the database of PACKBENCH_DB_URL and the archives.
"""

from __future__ import annotations

import argparse
from datetime import timezone

from packbench.core.report import read_screen
from packbench.db.store import Store


def _t(moment, t0: float) -> float:
    """Seconds from t0; NaN for a moment not reached (an attempt still running)."""
    if moment is None:
        return float("nan")
    return moment.replace(tzinfo=moment.tzinfo or timezone.utc).timestamp() - t0


def _episode_s(record: dict) -> float:
    """An episode's own time on its worker: `wall_s` when it finished, `episode_s` when it failed."""
    return record.get("wall_s") or record.get("episode_s") or 0.0


def _outside_ms(records: list[dict]) -> float:
    """Median worker time per plan entry outside the episode's wall (the policy's activation,
    the measurements), in ms; NaN for archives made before ok records carried `episode_s`."""
    extra = sorted(r["episode_s"] - r["wall_s"] for r in records if r.get("wall_s") and r.get("episode_s"))
    return 1e3 * extra[len(extra) // 2] if extra else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("t0", type=float)
    ap.add_argument("screens", type=int, nargs="+")
    args = ap.parse_args(argv)
    store = Store()
    screens = {}
    print(f"{'screen':>6} {'ray up':>7} {'spawn':>5} {'import':>6} {'init':>5} {'claim':>7} {'state':>5} {'load':>6} {'read':>5} {'warmups':>8} "
          f"{'scored':>7} {'end':>7} {'gap':>6}  first episode of each condition (s)")
    for sid in args.screens:
        a = store.latest_attempt(sid)
        if a is None:
            print(f"{sid:>6} never claimed")
            continue
        d = next((x for x in store.dispatchers() if x.id == a.dispatcher_id), None)
        s = screens[sid] = read_screen(a.archive_path)
        up = s.environment.get("startup") or {}
        warm = sum(_episode_s(e.record) for e in s.episodes if not e.scored)
        scored = sum(_episode_s(e.record) for e in s.episodes if e.scored)
        load = s.start.get("entry_to_loaded_s") or 0.0
        claim, end = _t(a.started_at, args.t0), _t(a.finished_at, args.t0)
        gap = (end - claim) - load - warm - scored  # driver, archive, verdicts, queueing
        firsts = " ".join(f"{_episode_s(e.record):.1f}" for e in s.episodes if not e.scored)
        print(f"{sid:>6} {_t(d.started_at, args.t0) if d else float('nan'):7.1f} "
              + " ".join(f"{up.get(k) or float('nan'):{w}.1f}" for k, w in (("process_s", 5), ("import_s", 6), ("init_s", 5)))
              + f" {claim:7.1f} "
              f"{a.model_state or '?':>5} {load:6.1f} {s.start.get('read_s') or 0:5.1f} {warm:8.1f} "
              f"{scored:7.1f} {end:7.1f} {gap:6.1f}  {firsts}")

    # Contention: each condition's median scored episode wall, screen by screen.
    if not screens:
        return
    conditions = next(iter(screens.values())).conditions
    print(f"{'median scored wall (ms)':>24} " + " ".join(f"{sid:>8}" for sid in screens))
    for c in conditions:
        print(f"{c:>24} " + " ".join(f"{1e3 * _median([_episode_s(e.record) for e in s.of(c)]):8.1f}"
                                     for s in screens.values()))
    print(f"{'outside the wall (ms)':>24} " + " ".join(f"{sid:>8}" for sid in screens))
    for c in conditions:
        print(f"{c:>24} " + " ".join(f"{_outside_ms([e.record for e in s.of(c)]):8.1f}" for s in screens.values()))


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


if __name__ == "__main__":
    main()
