#!/usr/bin/env bash
# One device call (issue 11, 2026-12-01): the engine's CUDA tests (dense-stream's copy stream
# included), then two alternated bench.engine runs:
#   1. opt-2.7b fp16 at 4800 MiB: dense-stream with one copy stream against the single-stream
#      schedule (bench-only `copies=single`), both modes; resident and packet (device gather)
#      in mode graph; accelerate's offload at the same allowance.
#   2. opt-6.7b fp16 at 11264 MiB (everything but the outgoing FFN weights fits; the whole model,
#      12.4 GiB, does not): resident (unbounded), dense-stream and packet (device gather), mode graph.
#   3. the seed-v0.40-shaped screen through `packbench submit --wait` and `audit`, mode graph
#      (bench/scale_device.sh; needs .whl carried).
# Run from the project root on the GPU machine; full logs go to $OUT when it is set.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_common.sh"; device_header
echo "== CUDA tests (engine)"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_dense_stream_cuda.py tests/engine/test_graph_cuda.py \
  tests/engine/test_policies_cuda.py > "$out/pytest.log" 2>&1; echo "pytest rc $?"; tail -4 "$out/pytest.log"
echo "== opt-2.7b"
timeout 200 python3 -m bench.engine --shape opt-2.7b --dtype float16 --prefix 512 --continuation 16 --rounds 2 --allowance-mib 4800 \
  --accelerate --conditions "dense-stream+copies=single,dense-stream,dense-stream+copies=single+mode=graph,dense-stream+mode=graph,\
resident+unbounded=yes+mode=graph,packet+gather=device+mode=graph" > "$out/bench27.log" 2>&1; echo "rc $?"
grep -vE "^\s*$" "$out/bench27.log" | tail -32
echo "== opt-6.7b"
timeout 150 python3 -m bench.engine --shape opt-6.7b --dtype float16 --prefix 512 --continuation 16 --rounds 2 --allowance-mib 11264 \
  --conditions "resident+unbounded=yes+mode=graph,dense-stream+mode=graph,packet+gather=device+mode=graph" \
  > "$out/bench67.log" 2>&1; echo "rc $?"
grep -vE "^\s*$" "$out/bench67.log" | tail -22
echo "== seed-v0.40-shaped screen through submit --wait, mode graph"
SKIP_13B=1 V040_MODES=graph timeout 110 bash bench/scale_device.sh > "$out/v040.log" 2>&1; echo "rc $?"; tail -20 "$out/v040.log"
date -u
