#!/usr/bin/env bash
# One device call (issues 24 and 26): the device gathers' kernels and what rides on them.
#  1. CUDA tests: the gathers (fp16 and the int8 kernel, columns split or not), int8 packets
#     bit-identical to the int8 dense-stream (captured in mode graph), the competitors.
#  2. bench.engine, alternated in one run (calibrated OPT-2.7B fp16, 3 x 512 + 16, 4800 MiB, graph):
#     packet with the columns split over programs at decode (`+split=64`) or not, the int8
#     packets (now captured) split or not, int8 dense-stream, resident unbounded (the floor's kernels).
#  3. bench.competitor_probe for torchao int8: eager and graph, shelve (what stays on the device), unshelve.
#  4. bench.batch: batched decode against batch size (issue 26 target 3), unless SKIP_BATCH.
# Carry .whl (EXTRA="torchao bitsandbytes"):  bash bench/split_device.sh
set -uo pipefail
root=$PWD; out=${OUT:-$root/split-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
device_header
echo "== CUDA tests"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gather.py \
  tests/engine/test_int8_packets_cuda.py tests/engine/test_quantized_cuda.py tests/engine/test_accelerate_cuda.py \
  > "$out/pytest.log" 2>&1; echo "pytest rc $?"; grep -E "passed|failed|Error|FAILED" "$out/pytest.log" | tail -12
echo "== bench.engine"
c="packet+gather=device+mode=graph,packet+gather=device+mode=graph+split=64"
c="$c,packet+gather=device+weights=int8+mode=graph,packet+gather=device+weights=int8+mode=graph+split=64"
c="$c,dense-stream+weights=int8+mode=graph,resident+unbounded=yes+mode=graph,dense-stream+mode=graph"
timeout 200 python3 -m bench.engine --shape opt-2.7b --dtype float16 --profile opt --prefix 512 --continuation 16 \
  --rounds 3 --allowance-mib 4800 --conditions "$c" > "$out/engine.log" 2>&1
echo "bench.engine rc $?"; grep -v -e Warning -e "Failed to load" "$out/engine.log" | tail -40
echo "== competitor probe (torchao int8)"
timeout 120 python3 -m bench.competitor_probe --shape opt-2.7b --methods int8-weight-only --modes eager,graph \
  --dir /tmp/m > "$out/probe.log" 2>&1; echo "probe rc $?"; grep -v -e Warning "$out/probe.log" | tail -30
if [ -z "${SKIP_BATCH:-}" ]; then
  echo "== batched decode"
  timeout "${BATCH_TIMEOUT:-200}" python3 -m bench.batch --shape opt-2.7b --dtype float16 --batches "${BATCHES:-1,2,4,8,16,32}" \
    --prefix 64 --continuation 16 --rounds 3 --mode graph --allowance-mib 4800 --dir /tmp/m > "$out/batch.log" 2>&1
  echo "bench.batch rc $?"; grep -v -e Warning -e "Failed to load" -e "register_constant" "$out/batch.log" | tail -20
fi
