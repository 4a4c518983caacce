#!/usr/bin/env bash
# One device call (issue 26): the seed's v0.42 screen (protocols/seed-v042.yaml) on its fast
# path: packet and phase-switched with the device gather, engine mode graph, through `packbench
# submit --wait` and `packbench audit`. Run from the project root with .whl carried:
#   bash bench/seed_fast_device.sh      (a CPU dry run: SKIP_WHEELS=1 SHAPE27=tiny PREFIX=64 ...)
set -uo pipefail
root=$PWD; out=${OUT:-$root/seed-fast-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
sed -e 's/gather: host/gather: device/g' -e 's/^name: seed-v042/name: seed-v042-fast/' \
    -e "s/opt-2.7b/${SHAPE27:-opt-2.7b}/" -e "s/^prefix_tokens: 512/prefix_tokens: ${PREFIX:-512}/" \
    "$root/protocols/seed-v042.yaml" > "$work/fast.yaml"
echo "engine: {mode: graph}" >> "$work/fast.yaml"
t0=$(date +%s)
pb submit "$work/fast.yaml" --wait > "$out/fast.log" 2>&1; echo "== seed-v042-fast: submit rc $? in $(( $(date +%s) - t0 )) s"
pb audit latest >> "$out/fast.log" 2>&1; echo "   audit rc $?"
grep -E "^(faithfulness|acquisition|runtime|resources|capacity) |audit of" "$out/fast.log" | sort -u
python3 -m bench.seed_screens | tee "$out/seed_screens.txt"
