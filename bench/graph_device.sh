#!/usr/bin/env bash
# One device call for mode graph (issue 11): the engine's CUDA tests, then eager and graph
# conditions alternated in one bench.engine run. Run from the project root on the GPU machine;
# logs go to $OUT when it is set. Usage: bash bench/graph_device.sh [ROUNDS] [CONDITIONS]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_common.sh"; device_header

echo "== CUDA tests (engine)"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_graph_cuda.py tests/engine/test_policies_cuda.py \
  tests/engine/test_dense_stream_cuda.py 2>&1 \
  | tee "$out/pytest.log" | tail -25

echo "== bench.engine, eager and graph alternated"
rounds=${1:-3}
conditions=${2:-"resident+unbounded=yes,resident+unbounded=yes+mode=graph,dense-stream,dense-stream+mode=graph,packet+gather=device,packet+gather=device+mode=graph,packet,packet+mode=graph"}
python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix 512 --continuation 16 --rounds "$rounds" \
  --allowance-mib 4800 --conditions "$conditions" 2>&1 | tee "$out/bench.log"
date -u
