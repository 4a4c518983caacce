#!/usr/bin/env bash
# One device call (issue 26, target 3): batched decode against batch size at opt-2.7b on the
# calibrated synthetic checkpoint (fp16, ALLOWANCE MiB): ms per token per sequence and bytes per
# decode call of dense-stream and packet {gather: device} (exact), and torchao's int8 weight-only
# resident model (approximate) in COMPETITOR_MODES, at batch 1, 2, 4, 8, 16 and 32, then
# the batch CUDA tests. torchao comes from .whl when carried (EXTRA="torchao" wheelhouse.sh);
# without it the competitor's cells say why:
#   bash bench/batch_device.sh
# Knobs: SHAPE (opt-2.7b), BATCHES (1,2,4,8,16,32), PREFIX (64: the KV cache of 32 sequences of
# 512 + 16 tokens alone would exceed the allowance at opt-2.7b), CONTINUATION (16), ROUNDS (3),
# MODE (graph: the exact loaders' fast path), COMPETITOR_MODES (compile: torchao's fastest; add
# eager for its slow mode), ALLOWANCE (5700 MiB: under the packets' 4800 the KV cache of 16 x 80
# tokens ran out of memory at opt-2.7b; for opt-13b about 22528), BATCH_TIMEOUT (480 s: each
# batch size compiles the competitor's step again), COMPETITOR_BATCHES (every batch; at opt-13b
# each compiled batch takes 2-4 minutes, so one call holds the loaders' sweep and one or two of
# them: docs/experiments/batched.md, "OPT-13B, measured"). Each batch's line carries its bytes and packet's
# bit check, so a call cut short keeps them.
set -uo pipefail
root=$PWD; out=${OUT:-$root/batch-out}; mkdir -p "$out"
source bench/device_common.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ls .whl/*.whl > /dev/null 2>&1 && install_wheels
device_header
echo "== batched decode"
timeout "${BATCH_TIMEOUT:-480}" python3 -m bench.batch --shape "${SHAPE:-opt-2.7b}" --dtype float16 --batches "${BATCHES:-1,2,4,8,16,32}" \
  --prefix "${PREFIX:-64}" --continuation "${CONTINUATION:-16}" --rounds "${ROUNDS:-3}" --mode "${MODE:-graph}" \
  --competitor-modes "${COMPETITOR_MODES:-compile}" --competitor-batches "${COMPETITOR_BATCHES:-}" --allowance-mib "${ALLOWANCE:-5700}" > "$out/batch.log" 2>&1; echo "bench.batch rc $?"
grep -v -e Warning -e "Failed to load" -e "register_constant" "$out/batch.log" | tail -30
echo "== CUDA tests (batch)"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_batch_cuda.py > "$out/pytest.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|Error" "$out/pytest.log" | tail -6
