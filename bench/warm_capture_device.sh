#!/usr/bin/env bash
# One device call (issue 11, 2026-12-01): mode graph without the per-episode eager warm-up.
#   1. every engine CUDA test (`pytest -m gpu tests/engine`);
#   2. bench.engine, opt-2.7b fp16 at 4800 MiB, mode graph, resident / dense-stream / packet
#      (device gather), alternated: the first decode call (warm-up and capture, or capture and
#      replay) and the episode wall beside the decode medians;
#   (PROFILE=1: then bench.step_profile's kernel time per call for resident and the device gather)
#   3. the seed-v0.40-shaped screen through `packbench submit --wait` and `audit`, mode graph,
#      three times (bench/scale_device.sh with V040_REPEATS=3; needs .whl carried).
# Run from the project root on the GPU machine; full logs go to $OUT when it is set.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_common.sh"; device_header
engine_cuda_tests
echo "== opt-2.7b, mode graph"
timeout 150 python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix 512 --continuation 16 --rounds 2 --allowance-mib 4800 \
  --conditions "resident+unbounded=yes+mode=graph,dense-stream+mode=graph,packet+gather=device+mode=graph" > "$out/bench27.log" 2>&1
echo "rc $?"; grep -vE "^\s*$" "$out/bench27.log" | tail -14
if [ -n "${PROFILE:-}" ]; then
  echo "== kernel time per decode call (bench.step_profile)"
  timeout 120 python3 -m bench.step_profile --shape opt-2.7b --dtype float16 --conditions "resident,packet+gather=device" 2>&1 \
    | grep -vE "Warning|_warn_once" | tail -8
fi
echo "== seed-v0.40-shaped screen through submit --wait, mode graph, three times"
SKIP_13B=1 V040_MODES=graph V040_REPEATS=3 timeout 200 bash bench/scale_device.sh > "$out/v040.log" 2>&1; echo "rc $?"
grep -E "^(v040|audit|screen|   median)" "$out/v040.log"
date -u
