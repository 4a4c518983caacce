#!/usr/bin/env bash
# One device call (issue 11, session 19): a warm policy's capture while the GPU runs the prefill
# (mode graph's default now) against the capture at the first decode call (`+capture=decode`),
# alternated in one bench.engine run per shape; then the seed-v0.40-shaped screen through
# `packbench submit --wait` three times (needs .whl carried).
#   1. every engine CUDA test;
#   2. opt-2.7b fp16 at 4800 MiB, the v0.40 shape (3 prompts x 32 + 16, 3 rounds): episode walls;
#   3. the same at 512 + 16, 2 rounds: the first decode call;
#   4. bench/scale_device.sh's v0.40 screens, mode graph, three times, and their audits.
# Run from the project root on the GPU machine; full logs go to $OUT when it is set.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_common.sh"; device_header
engine_cuda_tests
G=+mode=graph; D=+capture=decode; P=packet+gather=device$G
for shape in "32 3" "512 2"; do
  set -- $shape
  echo "== opt-2.7b, $1 + 16, $2 rounds"
  timeout 200 python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix $1 --continuation 16 --rounds $2 --allowance-mib 4800 \
    --conditions "dense-stream$G,dense-stream$G$D,$P,$P$D,resident+unbounded=yes$G,resident+unbounded=yes$G$D" > "$out/bench$1.log" 2>&1
  echo "rc $?"; grep -vE "^\s*$" "$out/bench$1.log" | grep -v "reproduces\|Loading" | tail -16
done
echo "== seed-v0.40-shaped screen through submit --wait, mode graph, three times"
SKIP_13B=1 V040_MODES=graph V040_REPEATS=3 timeout 240 bash bench/scale_device.sh > "$out/v040.log" 2>&1; echo "rc $?"
grep -E "^(v040|audit|screen|   median)" "$out/v040.log"
date -u
