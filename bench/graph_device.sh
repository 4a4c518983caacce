#!/usr/bin/env bash
# One device call for mode graph (issue 11): every engine CUDA test, then the given conditions
# alternated in one bench.engine run (fp16, 3 prompts x 512 + 16; SHAPE=opt-2.7b at ALLOWANCE=4800
# MiB by default; opt-6.7b takes 11264, opt-13b 20480), then, with PROFILE="cond,...",
# bench.step_profile's GPU time per decode call for those conditions. SKIP_TESTS=1 skips the tests.
# BENCH_ARGS passes more arguments to bench.engine (e.g. --accelerate).
# Run from the project root on the GPU machine; logs go to $OUT when it is set.
# Usage: [SHAPE=... ALLOWANCE=...] [PROFILE=...] bash bench/graph_device.sh [ROUNDS] [CONDITIONS]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_common.sh"; device_header
[ -z "${SKIP_TESTS:-}" ] && engine_cuda_tests
shape=${SHAPE:-opt-2.7b}

echo "== bench.engine, alternated"
rounds=${1:-3}
conditions=${2:-"resident+unbounded=yes,resident+unbounded=yes+mode=graph,dense-stream,dense-stream+mode=graph,packet+gather=device,packet+gather=device+mode=graph,packet,packet+mode=graph"}
echo "$shape, $rounds rounds: $conditions"
timeout 300 python3 -m bench.engine --shape "$shape" --dtype float16 --prefix 512 --continuation 16 --rounds "$rounds" \
  --allowance-mib "${ALLOWANCE:-4800}" --conditions "$conditions" ${BENCH_ARGS:-} > "$out/bench-$shape.log" 2>&1; echo "rc $?"
grep -vE "^\s*$" "$out/bench-$shape.log" | grep -v "Loading weights" | tail -20
if [ -n "${PROFILE:-}" ]; then
  echo "== GPU time per decode call (bench.step_profile)"
  timeout 150 python3 -m bench.step_profile --shape "$shape" --dtype float16 --conditions "$PROFILE" 2>&1 \
    | grep -vE "Warning|_warn_once" | tail -10
fi
date -u
