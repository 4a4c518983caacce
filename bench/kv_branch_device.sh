#!/usr/bin/env bash
# One device call (issue 11, 2026-12-01): k and v beside q in the captured pieces, against one
# after the other (bench.engine's `+kv=serial`), alternated in the same runs:
#   1. every engine CUDA test;
#   2. opt-2.7b fp16 at 4800 MiB, 3 prompts x 512 + 16: decode ms/token, first decode call, capture;
#   3. the seed-v0.40 shape (3 prompts x 32 + 16, 3 rounds): each condition's episode wall, so
#      packet (device gather) / dense-stream per schedule.
# Run from the project root on the GPU machine; full logs go to $OUT when it is set.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_common.sh"; device_header
engine_cuda_tests
G="+mode=graph"
echo "== opt-2.7b, 512 + 16"
timeout 200 python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix 512 --continuation 16 --rounds 2 --allowance-mib 4800 \
  --conditions "resident+unbounded=yes$G,resident+unbounded=yes$G+kv=serial,packet+gather=device$G,packet+gather=device$G+kv=serial,dense-stream$G" \
  > "$out/bench512.log" 2>&1; echo "rc $?"; grep -vE "^\s*$" "$out/bench512.log" | tail -17
echo "== opt-2.7b, seed-v0.40 shape: 32 + 16, 3 rounds"
timeout 200 python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix 32 --continuation 16 --rounds 3 --allowance-mib 4800 \
  --conditions "dense-stream$G,dense-stream$G+kv=serial,packet+gather=device$G,packet+gather=device$G+kv=serial" \
  > "$out/bench32.log" 2>&1; echo "rc $?"; grep -vE "^\s*$" "$out/bench32.log" | tail -12
date -u
