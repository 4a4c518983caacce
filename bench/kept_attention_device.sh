#!/usr/bin/env bash
# One device call (issue 11, 2026-12-01): mode graph with the live-span attention captured once
# per (layer, span) and kept across episodes (engine/graph.py KeptAttention).
#   1. every engine CUDA test;
#   2. opt-2.7b fp16 at 4800 MiB, 3 prompts x 512 + 16, 2 rounds: resident, dense-stream, packet
#      (device gather), mode graph: decode ms/token, first decode call, capture, episode wall;
#   3. the seed-v0.40 shape (3 prompts x 32 + 16, 3 rounds): dense-stream and packet (device
#      gather), mode graph: the episode walls' ratio.
# Run from the project root on the GPU machine; full logs go to $OUT when it is set.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_header.sh"; device_header
echo "== CUDA tests (engine)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine > "$out/pytest.log" 2>&1; echo "pytest rc $?"
grep -E "passed|failed|Error" "$out/pytest.log" | tail -8
G="+mode=graph"
echo "== opt-2.7b, 512 + 16"
timeout 150 python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix 512 --continuation 16 --rounds 2 --allowance-mib 4800 \
  --conditions "resident+unbounded=yes$G,dense-stream$G,packet+gather=device$G" > "$out/bench512.log" 2>&1; echo "rc $?"
grep -vE "^\s*$" "$out/bench512.log" | tail -12
echo "== opt-2.7b, seed-v0.40 shape: 32 + 16, 3 rounds"
timeout 120 python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix 32 --continuation 16 --rounds 3 --allowance-mib 4800 \
  --conditions "dense-stream$G,packet+gather=device$G" > "$out/bench32.log" 2>&1; echo "rc $?"
grep -vE "^\s*$" "$out/bench32.log" | tail -8
date -u
