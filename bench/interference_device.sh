#!/usr/bin/env bash
# One device call (issue 43): does a condition measure the same wherever it runs? The same exact
# conditions screened without a competitor ("exact"), with a compiled torchao competitor in the
# screen ("mixed"), and the competitor alone ("alone"), through `packbench submit --wait`,
# alternated (exact, mixed, alone, exact, mixed, alone, ...: REPEATS rounds, default 2) so drift
# hits them alike; PROMPTS (default 8) scored episodes per condition per screen on a calibrated
# synthetic OPT (SHAPE, default opt-2.7b, fp16; PREFIX + 16 tokens, default 512) under ALLOWANCE
# (default 4800 MiB), packbench's loaders in ENGINE_MODE (default graph), the competitor METHOD
# (default int8-weight-only) in MODE (default compile).
# Printed last, per condition and screen kind: the steady decode call (median of every decode
# call but each episode's first) with its 0.95 interval, mixed over exact and whether within 5 %;
# TTFT and TPOT; what happens once per episode apart (the first decode call's excess, the graph
# captured in it, a shelved competitor's unshelve before the wall); in the mixed screens, the
# steady call split by the condition the worker ran before, whether a slowdown persists after
# the competitor first ran (core.serving.persistent_slowdown), and the plan-position check.
# Every figure is core/serving.py's (docs/metrics.md), read from the archives. DEADLINE (seconds
# from the first screen, default 540) stops starting screens so the table still prints inside
# one 600 s device call; SCREEN_TIMEOUT (default 300) caps each screen.
#   bash bench/interference_device.sh
#   CPU dry run: SKIP_WHEELS=1 SHAPE=tiny DTYPE=float32 PREFIX=32 PROMPTS=2 REPEATS=1 MODE=eager ENGINE_MODE=eager \
#     OUT=/tmp/interference bash bench/interference_device.sh
set -uo pipefail
root=$PWD; out=${OUT:-$root/interference-out}; mkdir -p "$out"
source bench/device_common.sh
[ -n "${SKIP_HEADER:-}" ] || device_header 2>/dev/null
product_env
dtype=${DTYPE:-float16}
method=${METHOD:-int8-weight-only}
protocol() {  # kind: exact | mixed | alone
  local kind=$1
  { echo "schema: 7"; echo "name: interference-$kind"
    echo "model: {synth: {shape: ${SHAPE:-opt-2.7b}, dtype: $dtype, profile: opt, seed: 0}}"; echo "dtype: $dtype"
    echo "prompts: {generator: {seed: 0, count: ${PROMPTS:-8}}}"; echo "prefix_tokens: ${PREFIX:-512}"
    echo "continuation_tokens: 16"; echo "conditions:"
    if [ "$kind" != alone ]; then
      echo "  - {name: dense-stream, policy: dense-stream}"
      echo "  - {name: packet, policy: packet, params: {gather: device}}"
      echo "  - {name: resident, policy: resident, params: {allowance: unbounded}}"; fi
    [ "$kind" = exact ] || echo "  - {name: $method, policy: quantized, params: {method: $method, mode: ${MODE:-compile}}}"
    if [ "$kind" = alone ]; then echo "reference: $method"; else echo "reference: dense-stream"; fi
    echo "warmups: 1"; echo "allowance_mib: ${ALLOWANCE:-4800}"; echo "engine: {mode: ${ENGINE_MODE:-graph}}"
    echo "gates:"; echo "  resources: {}"
    [ "$kind" = alone ] || { echo "  faithfulness: {tolerance: 0.0}"
                             echo "  runtime: {control: dense-stream, max_ratio: 1.0}"; }
  } > "$work/$kind.yaml"
}
for kind in exact mixed alone; do protocol "$kind"; done
start=$(date +%s)
for round in $(seq 1 "${REPEATS:-2}"); do
  for kind in exact mixed alone; do
    t0=$(date +%s); left=$(( ${DEADLINE:-540} - (t0 - start) )); limit=${SCREEN_TIMEOUT:-300}
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -gt 45 ] || { echo "== round $round $kind: skipped, ${left} s left of DEADLINE"; continue; }
    timeout "$limit" python3 -m packbench submit "$work/$kind.yaml" --wait > "$out/$kind-$round.log" 2>&1
    echo "== round $round $kind: submit rc $? in $(( $(date +%s) - t0 )) s (limit $limit s)"
    grep -E "error|Error|failed" "$out/$kind-$round.log" | head -3
  done
done
python3 - "$out" <<'PY'
import math, statistics, sys
from packbench.core.report import plan_positions, read_screen
from packbench.core.serving import (by_previous, condition_serving, episode_serving, median_ratio,
                                    persistent_slowdown, position_text, scored_ok)
from packbench.db.store import Store

store = Store()
kinds: dict[str, list] = {}
for screen in store.list_screens():
    a = store.latest_attempt(screen.id)
    if a is None or not a.archive_path:
        continue
    s = read_screen(a.archive_path)
    kinds.setdefault(s.protocol.name.split("-", 1)[1], []).append(s)
print(f"screens: " + ", ".join(f"{k} x{len(v)}" for k, v in kinds.items()))

def records(kind, condition):
    return [r for s in kinds.get(kind, []) for r in scored_ok([e.record for e in s.episodes], condition)]

def steady(kind, condition):
    """(median, lo, hi, n) of the episodes' steady decode calls: the interval is the paired
    bootstrap of median(x) / median(1), i.e. of the median itself (PCG64 seed 0, 10000 resamples)."""
    xs = [f["steady_call_s"] for r in records(kind, condition) if (f := episode_serving(r)) and f["steady_call_s"]]
    if not xs:
        return None
    m = median_ratio(xs, [1.0] * len(xs))
    return m["value"], m["interval"][0], m["interval"][1], len(xs)

ms = lambda v: "-" if v is None else f"{v * 1e3:.3f}"
conditions = list(dict.fromkeys(c.name for ss in kinds.values() for s in ss for c in s.protocol.conditions))
print(f"\n{'condition':18} {'screen':6} {'n':>3} {'steady ms [0.95 interval]':>28} {'TTFT ms':>8} {'TPOT ms':>8} "
      f"{'once/ep ms':>10} {'capture ms':>10} {'unshelve ms':>11}")
for c in conditions:
    for kind in ("exact", "mixed", "alone"):
        rs = records(kind, c)
        if not rs:
            continue
        f, st = condition_serving(rs), steady(kind, c)
        cell = "-" if st is None else f"{st[0] * 1e3:.3f} [{st[1] * 1e3:.3f}, {st[2] * 1e3:.3f}]"
        print(f"{c:18} {kind:6} {len(rs):>3} {cell:>28} {ms(f['ttft_s']):>8} {ms(f['tpot_s']):>8} "
              f"{ms(f['first_decode_excess_s']):>10} {ms(f['capture_s']):>10} {ms(f['unshelve_s']):>11}")
print("\nsteady decode call, mixed screen over its own screen (exact conditions: over `exact`; the competitor: over `alone`)")
for c in conditions:
    base = "alone" if not records("exact", c) else "exact"
    a, b = steady(base, c), steady("mixed", c)
    if a and b:
        r = b[0] / a[0]
        print(f"  {c:18} {r:.3f} (mixed {b[0] * 1e3:.3f} ms over {base} {a[0] * 1e3:.3f} ms): "
              f"{'within' if abs(r - 1) <= 0.05 else 'NOT within'} 5 %")
for s in kinds.get("mixed", []):
    recs = [e.record for e in s.episodes]
    comp = [c.name for c in s.protocol.conditions if c.tier == "approximate"]
    print(f"\n{s.label}: {position_text(plan_positions([s]))}")
    for c in [c.name for c in s.protocol.conditions if c.tier == "exact"]:
        split = by_previous(recs, c)
        print(f"  {c:18} steady ms by what ran before: " + ", ".join(
            f"{p}: {v['median'] * 1e3:.3f} (n {v['n']})" for p, v in split.items() if v["median"] is not None))
        for other in comp:
            p = persistent_slowdown(recs, c, after=other)
            if p["ratio"] is not None:
                print(f"  {c:18} after {other} first ran: {p['ratio']:.3f}x ({p['n_before']} before, "
                      f"{p['n_since']} since){'  PERSISTENT SLOWDOWN' if p['slowed'] else ''}")
            else:  # the competitor's warmup runs before any scored episode: the exact screen is the before
                print(f"  {c:18} every scored episode ran after {other}'s first: the `exact` screens are its before")
PY
