#!/usr/bin/env bash
# One device call (issue 24): competitors beside exact packets through `packbench submit --wait`
# and `packbench audit` on a calibrated synthetic OPT (SHAPE, default opt-2.7b, fp16; PROMPTS x
# PREFIX + 16 tokens, default 3 x 512) under ALLOWANCE (default 4800 MiB, what packets need):
# accelerate's offload and low-bit models. The worker holds one condition's device state at a
# time (the CPU-first model parked on the host while a competitor runs, a torchao model shelved
# on the host while another condition runs), so each competitor has the allowance to itself.
# METHODS lists `method[:mode]` (default: every method, each in its fastest mode; schema 6 writes
# an omitted mode as core.registry.FASTEST_MODE: compile for int8, int4 and nf4, eager for llm-int8).
# The int8 packets (dense-stream and packet over int8 outgoing rows) run beside them unless
# SKIP_INT8_PACKETS; packbench's own loaders run in ENGINE_MODE (default graph). Then the
# competitors' CUDA tests unless SKIP_TESTS. Carry .whl built with
# EXTRA="torchao bitsandbytes":
#   bash bench/competitors_device.sh    (CPU dry run: SKIP_WHEELS=1 SHAPE=tiny PREFIX=32 METHODS=int8-weight-only ...)
#   SHAPE=opt-13b ALLOWANCE=20480 PROMPTS=2 SKIP_TESTS=1 bash bench/competitors_device.sh
# PER_METHOD=1 runs one screen per method (the checkpoint synthesised once), so a method that
# runs long leaves the others' figures; DEADLINE (seconds from the start) caps every screen's
# SCREEN_TIMEOUT to what is left of it; SKIP_PACKET, SKIP_RESIDENT leave those out; VERBOSE=1
# prints the worker's own output (Ray's log_to_driver) into each screen's log. PROFILE names the
# synthetic checkpoint's profile (default: none written, so the newest schema's, core.registry.NEWEST_PROFILE).
# Last, each archive's frontier and fidelity verdicts (bench/frontier.py).
set -uo pipefail
root=$PWD; out=${OUT:-$root/competitors-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
screen() {  # name methods...
  local name=$1; shift
  { echo "name: $name"; echo "model: {synth: {shape: ${SHAPE:-opt-2.7b}, dtype: float16, seed: 0${PROFILE:+, profile: $PROFILE}}}"; echo "dtype: float16"
    echo "prompts: {generator: {seed: 0, count: ${PROMPTS:-3}}}"; echo "prefix_tokens: ${PREFIX:-512}"; echo "continuation_tokens: 16"
    echo "conditions:"; echo "  - {name: dense-stream, policy: dense-stream}"
    [ -n "${SKIP_PACKET:-}" ] || echo "  - {name: packet, policy: packet, params: {gather: device}}"
    [ -n "${SKIP_RESIDENT:-}" ] || echo "  - {name: resident, policy: resident, params: {allowance: unbounded}}"  # the speed reference
    if [ -z "${SKIP_INT8_PACKETS:-}" ]; then  # quantized packets: exact against the int8 dense-stream
      echo "  - {name: dense-stream-int8, policy: dense-stream, params: {weights: int8}}"
      echo "  - {name: packet-int8, policy: packet, params: {gather: device, weights: int8}}"; fi
    [ -n "${SKIP_ACCELERATE:-}" ] || echo "  - {name: accelerate, policy: accelerate}"
    for m in "$@"; do
      method=${m%%:*}; mode=${m#*:}
      if [ "$mode" = "$m" ]; then echo "  - {name: $method, policy: quantized, params: {method: $method}}"
      else echo "  - {name: $method-$mode, policy: quantized, params: {method: $method, mode: $mode}}"; fi
    done
    echo "reference: dense-stream"; echo "warmups: 1"; echo "allowance_mib: ${ALLOWANCE:-4800}"
    echo "engine: {mode: ${ENGINE_MODE:-graph}}"  # packbench's own loaders in their fastest mode too
    echo "gates:"; echo "  faithfulness: {tolerance: 0.0}"; echo "  resources: {}"
    echo "  fidelity: {max_mean_kl: 0.002, min_top1: 0.98}"; } > "$work/$name.yaml"
  t0=$(date +%s); local limit=${SCREEN_TIMEOUT:-560} left=$(( ${DEADLINE:-100000} - (t0 - start) ))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -gt 30 ] || { echo "== $name: skipped, ${left} s left of DEADLINE"; return; }
  timeout "$limit" python3 -m packbench ${VERBOSE:+--verbose} submit "$work/$name.yaml" --wait > "$out/$name.log" 2>&1
  echo "== $name: submit rc $? in $(( $(date +%s) - t0 )) s (limit $limit s)"
  pb audit latest >> "$out/$name.log" 2>&1; echo "   audit rc $?"
  grep -E "^(faithfulness|fidelity|resources) |audit of|error" "$out/$name.log" | sort -u | head -20
  pb results --screen latest --json > "$out/$name.json" 2>/dev/null
}
start=$(date +%s)
if [ -n "${PER_METHOD:-}" ]; then
  for m in ${METHODS:-int8-weight-only int4-weight-only nf4 llm-int8}; do screen "competitors-${m/:/-}" "$m"; done
else screen competitors ${METHODS:-int8-weight-only int4-weight-only nf4 llm-int8}; fi
python3 - <<'PY'  # medians over scored episodes; decode ms/token over the continuation's decode calls
import statistics, os
from packbench.db.store import Store
s, n = Store(), 15
med = lambda xs: statistics.median(xs) if xs else float("nan")
for screen in s.list_screens():
    a = s.latest_attempt(screen.id)
    if a is None:
        continue
    print(f"screen {screen.id} {screen.protocol}: {a.status}")
    print(f"  {'condition':22} {'ok':>3} {'prefill ms':>10} {'decode ms/tok':>13} {'peak alloc MiB':>14} "
          f"{'peak sampled MiB':>16} {'MB/token':>9} {'mean KL':>9} {'top1':>6}")
    by = {}
    for e in s.episodes(a.id):
        if e.status != "ok":
            print(f"  episode {e.plan_index} {e.condition} failed: {(e.error or '')[:300]}")
        if e.role == "scored":
            by.setdefault(e.condition, []).append(e)
    for c, eps in by.items():
        ok = [x for x in eps if x.status == "ok"]
        kl = [x.fidelity_mean_kl for x in ok if x.fidelity_mean_kl is not None]
        top = [x.fidelity_top1 for x in ok if x.fidelity_top1 is not None]
        print(f"  {c:22} {len(ok):>3} {med([(x.prefill_call_s or 0) * 1e3 for x in ok]):>10.1f} "
              f"{med([(x.decode_call_s or 0) / n * 1e3 for x in ok]):>13.2f} "
              f"{max([(x.peak_allocated_bytes or 0) for x in ok], default=0) / 2**20:>14.0f} "
              f"{max([(x.peak_sampled_bytes or 0) for x in ok], default=0) / 2**20:>16.0f} "
              f"{med([(x.decode_h2d_bytes or 0) / n / 1e6 for x in ok]):>9.1f} "
              f"{(med(kl) if kl else float('nan')):>9.5f} {(med(top) if top else float('nan')):>6.3f}")
PY
echo; python3 -m bench.frontier "$PACKBENCH_ARCHIVE_DIR"/*.zip 2>&1 | tee "$out/frontier.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_accelerate_cuda.py \
    tests/engine/test_quantized_cuda.py tests/engine/test_int8_packets_cuda.py > "$out/pytest.log" 2>&1
  echo "competitor CUDA tests rc $?: $(tail -1 "$out/pytest.log")"
fi
