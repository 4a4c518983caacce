#!/usr/bin/env bash
# One device call (issue 26): the seed's v0.42 screen (protocols/seed-v042.yaml) on its fast
# path: packet and phase-switched with the device gather, engine mode graph, through `packbench
# submit --wait` and `packbench audit`. Run from the project root with .whl carried:
#   bash bench/seed_fast_device.sh      (a CPU dry run: SKIP_WHEELS=1 SHAPE27=tiny PREFIX=64 ...)
# PASSES=separate runs it with `passes: separate` (issue 26 target 5: each episode timed with the
# ledger and the sampler off, then recorded with both on) and prints the report's measurement
# cost per condition: the recording pass's wall over the timing pass's.
set -uo pipefail
root=$PWD; out=${OUT:-$root/seed-fast-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
sed -e 's/gather: host/gather: device/g' -e 's/^name: seed-v042/name: seed-v042-fast/' \
    -e "s/opt-2.7b/${SHAPE27:-opt-2.7b}/" -e "s/^prefix_tokens: 512/prefix_tokens: ${PREFIX:-512}/" \
    "$root/protocols/seed-v042.yaml" > "$work/fast.yaml"
echo "engine: {mode: graph}" >> "$work/fast.yaml"
if [ "${PASSES:-together}" = separate ]; then
  sed -i 's/^name: seed-v042-fast/name: seed-v042-fast-passes/' "$work/fast.yaml"; echo "passes: separate" >> "$work/fast.yaml"; fi
t0=$(date +%s)
pb submit "$work/fast.yaml" --wait > "$out/fast.log" 2>&1; echo "== seed-v042-fast: submit rc $? in $(( $(date +%s) - t0 )) s"
pb audit latest >> "$out/fast.log" 2>&1; echo "   audit rc $?"
grep -E "^(faithfulness|acquisition|runtime|resources|capacity) |audit of" "$out/fast.log" | sort -u
python3 -m bench.seed_screens | tee "$out/seed_screens.txt"
pb report latest --out "$out/report.html" > /dev/null 2>&1; echo "report rc $?"
pb results --screen latest --json > "$out/results.json" 2>/dev/null
[ "${PASSES:-together}" = separate ] && python3 - "$out/results.json" <<'PY'  # the report's cost table, as text
import json, sys
from packbench.core.report import measurement_cost, read_screen
with open(sys.argv[1]) as f:
    cost = measurement_cost(read_screen(json.load(f)["archive_path"]))  # the archive the screen wrote
print(f"measurement cost ({cost['passes']}): {'condition':16} {'n':>2} {'timing s':>9} {'recording s':>11} {'ratio':>7} "
      f"{'decode ms t/r':>15}")
for r in cost["conditions"]:
    print(f"  {r['condition']:16} {r['n']:>2} {r['timing_wall_s']:>9.4f} {r['recording_wall_s']:>11.4f} {r['ratio']:>7.4f} "
          f"{r['timing_decode_s'] * 1e3:>7.3f}/{r['recording_decode_s'] * 1e3:.3f}")
PY
