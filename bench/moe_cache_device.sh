#!/usr/bin/env bash
# One device call (issue 45): MoE expert caches and forecasts on the H200, each hit rate beside
# Belady's optimum for the same capacity on the same routing.
#   For a Qwen3-30B-A3B-shaped (12 of 48 layers) and a Mixtral-8x7B-shaped (4 of 32 layers)
#   synthetic checkpoint in fp16 (routing calibrated to the published figures), under a 24 GiB
#   allowance, through `packbench submit --wait` and `packbench audit`: dense-stream (the
#   reference), expert packets, expert-cache LRU at three capacities (Qwen3 16/32/64 of 128,
#   Mixtral 2/4/6 of 8), LFU at the middle one, expert-forecast, and the middle LRU cache with the
#   forecast. Every condition is judged bit for bit against dense-stream (faithfulness gate).
#   Prints per condition: decode ms/token, host-to-device MB per decode token, hit rate / Belady
#   (all calls, and decode calls), forecast used / wasted; then the CUDA tests of the caches.
# Run from the project root with .whl carried:  bash bench/moe_cache_device.sh
# Logs under $OUT (or ./moe-cache-out); ONLY=qwen or ONLY=mixtral runs one shape.
# The CPU-sized version, end to end on the tiny shapes (no wheels, no GPU):
#   TINY=1 bash bench/moe_cache_device.sh
set -uo pipefail
root=$PWD
out=${OUT:-$root/moe-cache-out}; mkdir -p "$out"
if [ -n "${TINY:-}" ]; then
  : "${QWEN_CAPS:=2 4 8}" "${DTYPE:=float32}"
fi
source bench/device_common.sh
moe_begin
DT=${DTYPE:-float16}
SHAPES=${ONLY:-qwen mixtral}
mapfile -t specs < <(moe_specs)
for spec in "${specs[@]}"; do
  set -- $spec; shape=$1; layers=$2; dir=$work/$shape
  caps=$(moe_cache_caps "$shape")
  set -- $caps; lo=$1; mid=$2; hi=$3
  moe_synth "$shape" "$layers" "$dir" "$DT"
  cat > "$work/$shape.yaml" <<YAML
$(moe_protocol_head "moe-cache-$shape-$layers" "$dir" 0)
conditions:
  - {policy: dense-stream}
  - {policy: packet}
$(moe_cache_conditions $lo $mid $hi)
reference: dense-stream
warmups: 1
allowance_mib: $ALLOW
gates: {faithfulness: {}}
YAML
  pb protocol plan "$work/$shape.yaml" > "$out/$shape-plan.log" 2>&1; echo "-- plan rc $?"; tail -10 "$out/$shape-plan.log"
  t0=$(date +%s)
  pb submit "$work/$shape.yaml" --wait > "$out/$shape-submit.log" 2>&1; echo "-- submit rc $? in $(( $(date +%s) - t0 )) s"
  pb audit latest >> "$out/$shape-submit.log" 2>&1; echo "   audit rc $?"
  verdict "$out/$shape-submit.log"
  grep -E "^(faithfulness|resources|capacity) " "$out/$shape-submit.log" | head -12
  pb results --screen latest > "$out/$shape-results.txt" 2>&1; echo "   results rc $?"
  python3 -m bench.moe_cache "$work/archives" | tee "$out/$shape-table.txt"
  rm -rf "$dir"  # the next shape's checkpoint needs the disk
done
if [ "$DEV" = cuda ]; then
  echo "== CUDA tests (expert caches)"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_moe_cache.py > "$out/pytest.log" 2>&1
  echo "pytest rc $?"; grep -E "passed|failed|Error" "$out/pytest.log" | tail -4
fi
moe_end
