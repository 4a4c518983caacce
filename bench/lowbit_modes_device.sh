#!/usr/bin/env bash
# One device call (issue 24): each low-bit method in the modes a protocol may ask for, timed alone
# on the calibrated synthetic checkpoint (bench/competitor_probe.py: build, two episodes per mode,
# shelve and return), then the competitors' CUDA tests. Within a method the modes run eager,
# compile, graph: a failed capture comes last and cannot touch the others' figures. Carry .whl
# built with EXTRA="torchao bitsandbytes":
#   bash bench/lowbit_modes_device.sh
# Knobs: SHAPE (opt-2.7b), METHODS (int4-weight-only,nf4: the ones without an H200 figure in their
# fastest mode; int8-weight-only's is in docs/benchmarks.md), MODES (eager,compile,graph), PROBE_S (360).
set -uo pipefail
out=${OUT:-$PWD/lowbit-out}; mkdir -p "$out"
source bench/device_common.sh
install_wheels
device_header
echo "== each method in each mode, alone"
timeout "${PROBE_S:-360}" python3 -m bench.competitor_probe --shape "${SHAPE:-opt-2.7b}" --methods "${METHODS:-int4-weight-only,nf4}" \
  --modes "${MODES:-eager,compile,graph}" --stuck-s 240 > "$out/probe.log" 2>&1; echo "probe rc $?"
grep -E "build|episode|decode median|FAILED|shelve" "$out/probe.log" | tail -40
echo "== CUDA tests (competitors)"
timeout 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine/test_quantized_cuda.py \
  tests/engine/test_accelerate_cuda.py > "$out/pytest.log" 2>&1; echo "pytest rc $?"
grep -E "passed|failed|Error|^nf4|^int8|^compile" "$out/pytest.log" | tail -12
