#!/usr/bin/env bash
# One device call (issue 26, targets 2 and 3):
#  1. bench.gather_floor: one decode token's active-row copies against their PCIe floor, per
#     variant in one CUDA graph (the copy engine per layer and whole, contiguous SM and TMA reads,
#     the shipped gather, its stores and reads apart, listed rows, TMA rows, fc2 after the gather),
#     at SHAPES (opt-2.7b,opt-13b); if it fails, again without the TMA variants (--no-tma);
#  2. unless SKIP_ENGINE: bench.engine, alternated: packet {gather: device} at its shipped tile and at
#     TILES (with the columns split; TILES= for none), beside resident (calibrated OPT-2.7B fp16,
#     3 x 512 + 16, 4800 MiB, graph);
#  3. unless SKIP_BATCH: bench.batch at OPT-2.7B, BATCHES (16,32) with torchao int8 compiled at
#     COMPETITOR_BATCHES (32); carry .whl (EXTRA="torchao bitsandbytes") for it.
#     bash bench/floor_device.sh       SKIP_BATCH=1 TILES= SHAPES=opt-2.7b bash bench/floor_device.sh
set -uo pipefail
root=$PWD; out=${OUT:-$root/floor-out}; mkdir -p "$out"
source bench/device_common.sh
export PYTHONUNBUFFERED=1
[ -n "${SKIP_BATCH:-}" ] || install_wheels
device_header
for shape in $(echo "${SHAPES:-opt-2.7b,opt-13b}" | tr , ' '); do
  echo "== gather floor $shape"
  timeout 200 python3 -m bench.gather_floor --shape "$shape" > "$out/floor-$shape.log" 2>&1; rc=$?
  echo "gather_floor rc $rc"; grep -v Warning "$out/floor-$shape.log" | tail -24
  if [ $rc -ne 0 ]; then
    timeout 150 python3 -m bench.gather_floor --shape "$shape" --no-tma > "$out/floor-$shape-notma.log" 2>&1
    echo "gather_floor --no-tma rc $?"; grep -v Warning "$out/floor-$shape-notma.log" | tail -20
  fi
done
if [ -z "${SKIP_ENGINE:-}" ]; then
  echo "== bench.engine (tiles)"
  c="packet+gather=device+mode=graph,resident+unbounded=yes+mode=graph"
  for t in $(echo "${TILES-32:256:8,16:256:4,64:256:8}" | tr , ' '); do c="$c,packet+gather=device+mode=graph+tile=$t"; done
  timeout 240 python3 -m bench.engine --shape opt-2.7b --dtype float16 --profile opt --prefix 512 --continuation 16 \
    --rounds 3 --allowance-mib 4800 --conditions "$c" > "$out/engine.log" 2>&1
  echo "bench.engine rc $?"; grep -v -e Warning -e "Failed to load" "$out/engine.log" | tail -24
fi
if [ -z "${SKIP_BATCH:-}" ]; then
  echo "== batched decode (opt-2.7b)"
  timeout "${BATCH_TIMEOUT:-240}" python3 -m bench.batch --shape opt-2.7b --dtype float16 --batches "${BATCHES:-16,32}" \
    --prefix 64 --continuation 16 --rounds 3 --mode graph --competitor-modes compile \
    --competitor-batches "${COMPETITOR_BATCHES:-32}" --allowance-mib 5700 > "$out/batch.log" 2>&1
  echo "bench.batch rc $?"; grep -v -e Warning -e "Failed to load" -e "register_constant" "$out/batch.log" | tail -24
fi
