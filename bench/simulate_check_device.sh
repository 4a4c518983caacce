#!/usr/bin/env bash
# One device call per shape (issue 45): is `packbench simulate`'s time a prediction? In order, for a
# Qwen3-30B-A3B-shaped (12 of 48 layers) or Mixtral-8x7B-shaped (4 of 32) synthetic checkpoint, fp16:
#   (i)   the rates into $OUT/machine.json: bench.moe_overhead's fixed costs (a tiny synthetic layer
#         set, never the conditions below), the pinned copy rate (bench.simulate_check measure), and
#         the compute: a rates screen through `packbench submit --wait` on a held-out prompt (the
#         generator at seed 1), `resident` and `cache-all` (an expert cache of every expert), whose
#         worker times them by the rule and in the process that time the screen below
#         (`measure --rates-from`; RATES_REPS scored episodes each, default 5; its archive is kept
#         apart, under rates/, and not audited);
#   (ii)  the routing the runs will see: one traced resident episode of the protocol's prompt, full
#         depth, on the device ($OUT/routing.trace);
#   (iii) `packbench simulate` on that trace with that machine file: $OUT/predictions.md (and .json),
#         sha256 printed, BEFORE any measured condition starts;
#   (iv)  the screen through `packbench submit --wait` + `packbench audit` under a 24 GiB allowance:
#         dense-stream (the reference), packet (device gather), LRU at three capacities, LFU,
#         expert-forecast, LRU + forecast, REPS scored episodes each (default 2);
#   (v)   predicted against measured per condition: ms/token, MB/token, hit %, ratio, within 15 %.
# Run from the project root with .whl carried:  ONLY=qwen bash bench/simulate_check_device.sh
#                                                ONLY=mixtral bash bench/simulate_check_device.sh
# Logs under $OUT (or ./simulate-check-out). DEADLINE (s, default 560) bounds the call: the screen
# gets what is left less the comparison's margin; REPS=1 if a shape runs short; OVERHEAD_FROM=FILE takes
# the fixed costs from an earlier call's overhead.json, or a machine file's overhead_us (bench/machines/h100.json;
# its other rates are not taken), instead of measuring them again. The CPU-sized
# version on the tiny shapes:
#   TINY=1 bash bench/simulate_check_device.sh
set -uo pipefail
t_start=$(date +%s)
root=$PWD
out=${OUT:-$root/simulate-check-out}; mkdir -p "$out"
if [ -n "${TINY:-}" ]; then
  : "${QWEN_CAPS:=2 4 8}" "${DTYPE:=float32}" "${OVERHEAD_ARGS:=--calls 10 --rounds 1}"
fi
source bench/device_common.sh
moe_begin
DT=${DTYPE:-float16}
REPS=${REPS:-2}
RATES_REPS=${RATES_REPS:-5}  # two short conditions, alternated: an odd count whose median one slow episode cannot move
DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - ($(date +%s) - t_start) )); }
SHAPES=${ONLY:-qwen}
mapfile -t specs < <(moe_specs)
[ "${#specs[@]}" = 1 ] || { echo "ONLY=$SHAPES: one shape a call, ONLY=qwen or ONLY=mixtral"; exit 2; }
set -- ${specs[0]}; shape=$1; layers=$2; dir=$work/$shape
caps=$(moe_cache_caps "$shape")
set -- $caps; lo=$1; mid=$2; hi=$3

echo "== (i) rates: the engine's fixed costs (bench.moe_overhead, tiny synthetic layers)"
if [ -n "${OVERHEAD_FROM:-}" ]; then  # a fragment this machine kind measured in an earlier call (saves ~1 min)
  # a path in the checkout (only the checkout travels to the device); a missing one stops the call here,
  # before predictions without the overhead term are written and screened
  cp "$OVERHEAD_FROM" "$out/overhead.json" || { echo "-- OVERHEAD_FROM=$OVERHEAD_FROM: not readable here"; exit 1; }
  echo "-- moe_overhead: taken from $OVERHEAD_FROM"
else
  t0=$(date +%s)
  python3 -m bench.moe_overhead --device "$DEV" ${OVERHEAD_ARGS:-} --out "$out/overhead.json" > /dev/null 2> "$out/overhead.log"
  echo "-- moe_overhead rc $? in $(( $(date +%s) - t0 )) s"; grep -E "^(copy|packet|dense|expert|forecast)" "$out/overhead.log"
fi
moe_synth "$shape" "$layers" "$dir" "$DT"
ov=(); [ -s "$out/overhead.json" ] && ov=(--overhead "$out/overhead.json")  # without it: predictions say the term is missing
experts=$(python3 -c "import json, sys; c = json.load(open(sys.argv[1] + '/config.json'))
print(c.get('num_experts') or c['num_local_experts'])" "$dir")
cat > "$work/$shape-rates.yaml" <<YAML
$(moe_protocol_head "simulate-rates-$shape-$layers" "$dir" 1)
conditions:
  - {policy: resident}
  - {name: cache-all, policy: expert-cache, params: {capacity: $experts}}
reference: resident
warmups: 1
repetitions: $RATES_REPS
allowance_mib: $ALLOW
gates: {faithfulness: {}}
YAML
t0=$(date +%s)
timeout 200 "${py:-python3}" -m packbench submit "$work/$shape-rates.yaml" --wait > "$out/rates.log" 2>&1
rc=$?; echo "-- (i) the rates screen: rc $rc in $(( $(date +%s) - t0 )) s"
mkdir -p "$work/rates"; mv "$work"/archives/* "$work/rates/" 2>/dev/null  # compare reads only the screen's
rates=$(find "$work/rates" -name "*.zip" | head -1)
[ $rc = 0 ] && [ -n "$rates" ] || { echo "-- no rates screen archive: nothing predicted"; tail -5 "$out/rates.log"; moe_end; exit 1; }
t0=$(date +%s)
python3 -m bench.simulate_check measure --model "$dir" --device "$DEV" --dtype "$DT" --prefix "$P" --continuation "$C" \
  "${ov[@]}" --rates-from "$rates" --machine-out "$out/machine.json" --trace-out "$out/routing.trace" \
  > "$out/measure.log" 2>&1
rc=$?; echo "-- (i)+(ii) copy rate, the rates screen's compute, trace: rc $rc in $(( $(date +%s) - t0 )) s"
grep -E "^(copy rate|resident|trace|wrote|WARNING)" "$out/measure.log"
[ $rc = 0 ] || { tail -5 "$out/measure.log"; moe_end; exit 1; }
sha256sum "$out/machine.json" "$out/routing.trace"

echo "== (iii) predictions, written before any measured condition"
names=(dense-stream packet lru-$lo lru-$mid lru-$hi lfu-$mid expert-forecast lru-$mid-forecast)
policies=(dense-stream packet:gather=device "expert-cache:capacity=$lo,rule=lru" "expert-cache:capacity=$mid,rule=lru"
          "expert-cache:capacity=$hi,rule=lru" "expert-cache:capacity=$mid,rule=lfu" expert-forecast
          "expert-cache:capacity=$mid,rule=lru,forecast=on")
cond_args=(); for i in "${!names[@]}"; do cond_args+=(--condition "${names[$i]}=${policies[$i]}"); done
python3 -m bench.simulate_check predict --trace "$out/routing.trace" --machine "$out/machine.json" \
  --out "$out/predictions.md" "${cond_args[@]}" 2> "$out/predict.err"
rc=$?; echo "-- predict rc $rc"; [ $rc = 0 ] || { tail -5 "$out/predict.err"; moe_end; exit 1; }

echo "== (iv) the screen ($(left) s left)"
cat > "$work/$shape.yaml" <<YAML
$(moe_protocol_head "simulate-check-$shape-$layers" "$dir" 0)
conditions:
  - {policy: dense-stream}
  - {policy: packet, params: {gather: device}}
$(moe_cache_conditions $lo $mid $hi)
reference: dense-stream
warmups: 1
repetitions: $REPS
allowance_mib: $ALLOW
gates: {faithfulness: {}}
YAML
pb protocol plan "$work/$shape.yaml" > "$out/plan.log" 2>&1; echo "-- plan rc $?"; tail -4 "$out/plan.log"
budget=$(( $(left) - 45 ))  # the comparison and the archive copy need the rest
if [ "$budget" -lt 60 ]; then
  echo "-- submit skipped: $budget s left of DEADLINE $DEADLINE (run this shape alone, or with REPS=1 / OVERHEAD_FROM)"
else
  t0=$(date +%s)
  timeout "$budget" "${py:-python3}" -m packbench submit "$work/$shape.yaml" --wait > "$out/submit.log" 2>&1
  echo "-- submit rc $? in $(( $(date +%s) - t0 )) s (limit $budget s)"
  pb audit latest >> "$out/submit.log" 2>&1; echo "   audit rc $?"
  verdict "$out/submit.log"
  grep -E "^(faithfulness|resources|capacity) " "$out/submit.log" | head -12
fi

echo "== (v) predicted against measured"
python3 -m bench.simulate_check compare --predictions "$out/predictions.json" --archives "$work/archives" \
  --out "$out/compare.md" | tee "$out/compare.txt"
rm -rf "$dir"
moe_end
# A device call brings back at most 8 files (alphabetically first): the logs go into one tarball so
# that the predictions, the rates, the routing trace and the comparison come back beside it (with
# the caller's stdout.txt; the archive is too large to come back).
(cd "$out" && tar czf logs.tgz --remove-files ./*.log ./*.err compare.txt 2>/dev/null)
echo "done in $(( $(date +%s) - t_start )) s"
