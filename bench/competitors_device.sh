#!/usr/bin/env bash
# One device call (issue 24): competitors beside exact packets through `packbench submit --wait`
# and `packbench audit` on a calibrated synthetic OPT-2.7B fp16 (3 prompts x 512 + 16), under
# ALLOWANCE (default 4800 MiB, what packets need): accelerate's offload and low-bit models. The
# worker holds one condition's device state at a time (the CPU-first model parked on the host
# while a competitor runs), so each competitor has the allowance to itself. METHODS lists
# `method[:mode]` (schema 6: an omitted mode is the library's fastest, compile for torchao).
# Then int4 alone (its kernel may be missing). Carry .whl built with EXTRA="torchao bitsandbytes accelerate psutil":
#   bash bench/competitors_device.sh    (CPU dry run: SKIP_WHEELS=1 SHAPE27=tiny PREFIX=32 METHODS=int8-weight-only ...)
set -uo pipefail
root=$PWD; out=${OUT:-$root/competitors-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
screen() {  # name methods...
  local name=$1; shift
  { echo "name: $name"; echo "model: {synth: {shape: ${SHAPE27:-opt-2.7b}, dtype: float16, seed: 0}}"; echo "dtype: float16"
    echo "prompts: {generator: {seed: 0, count: 3}}"; echo "prefix_tokens: ${PREFIX:-512}"; echo "continuation_tokens: 16"
    echo "conditions:"; echo "  - {name: dense-stream, policy: dense-stream}"
    echo "  - {name: packet, policy: packet, params: {gather: device}}"
    [ -n "${SKIP_ACCELERATE:-}" ] || echo "  - {name: accelerate, policy: accelerate}"
    for m in "$@"; do
      method=${m%%:*}; mode=${m#*:}
      if [ "$mode" = "$m" ]; then echo "  - {name: $method, policy: quantized, params: {method: $method}}"
      else echo "  - {name: $method-$mode, policy: quantized, params: {method: $method, mode: $mode}}"; fi
    done
    echo "reference: dense-stream"; echo "warmups: 1"; echo "allowance_mib: ${ALLOWANCE:-4800}"
    echo "gates:"; echo "  faithfulness: {tolerance: 0.0}"; echo "  resources: {}"
    echo "  fidelity: {max_mean_kl: 0.002, min_top1: 0.98}"; } > "$work/$name.yaml"
  t0=$(date +%s)
  pb submit "$work/$name.yaml" --wait > "$out/$name.log" 2>&1; echo "== $name: submit rc $? in $(( $(date +%s) - t0 )) s"
  pb audit latest >> "$out/$name.log" 2>&1; echo "   audit rc $?"
  grep -E "^(faithfulness|fidelity|resources) |audit of|error" "$out/$name.log" | sort -u | head -20
  pb results --screen latest --json > "$out/$name.json" 2>/dev/null
}
screen competitors ${METHODS:-int8-weight-only int8-weight-only:eager nf4 llm-int8}
[ -n "${SKIP_INT4:-}" ] || SKIP_ACCELERATE=1 screen int4 int4-weight-only
python3 - "$out" <<'PY'  # decode ms/token: the decode calls' time over the 15 of a 16-token episode
import json, statistics, sys
from db.store import Store
s = Store()
for screen in s.list_screens():
    a = s.latest_attempt(screen.id)
    if a is None:
        continue
    print(f"screen {screen.id} {screen.protocol}: {a.status}")
    by = {}
    for e in s.episodes(a.id):
        if e.role == "scored" and e.status == "ok":
            by.setdefault(e.condition, []).append(e)
    for c, eps in by.items():
        print(f"  {c:18} median episode wall {statistics.median(x.wall_s for x in eps):.4f} s, "
              f"decode {statistics.median((x.decode_call_s or 0) / 15 for x in eps) * 1e3:.2f} ms/token, "
              f"peak sampled {max((x.peak_sampled_bytes or 0) for x in eps) / 2**20:.0f} MiB")
PY
