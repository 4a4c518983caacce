#!/usr/bin/env bash
# One device call (issue 44): MoE models as exact expert packets on the H200.
#   For a Qwen3-30B-A3B-shaped and a Mixtral-8x7B-shaped synthetic checkpoint in fp16 (routing
#   calibrated to the published figures, drawn on the GPU; the real layer shapes, fewer layers:
#   QWEN_LAYERS=12 of 48 (12 x 1.125 GiB of experts) and MIXTRAL_LAYERS=4 of 32 (4 x 2.625 GiB),
#   so that a checkpoint writes, reads and pins within the call's 10 minutes and 64 GB of disk):
#   A. bench.moe: every expert policy exact against dense-stream (and dense-stream against stock
#      transformers with every weight on the GPU, eager), decode ms/token, bytes per token,
#      and the floor (resident's decode time + the packet's bytes at the pinned copy rate); then
#      `model stats` on the GPU: the checkpoint's routing beside the published figures;
#   B. the same policies through `packbench submit --wait` under a 24 GiB allowance, then `audit`.
# Run from the project root with .whl carried:  bash bench/moe_device.sh
# Logs under $OUT (or ./moe-out); ONLY=A or ONLY=B runs one part; SHAPES="qwen" or "mixtral" one
# shape. The CPU-sized version on the tiny shapes (no wheels, no GPU):  TINY=1 bash bench/moe_device.sh
set -uo pipefail
root=$PWD
out=${OUT:-$root/moe-out}; mkdir -p "$out"
source bench/device_common.sh
moe_begin
mapfile -t specs < <(moe_specs)
for spec in "${specs[@]}"; do
  set -- $spec; shape=$1; layers=$2; dir=$work/$shape
  moe_synth "$shape" "$layers" "$dir"
  if [ "${ONLY:-A}" = A ] || [ -z "${ONLY:-}" ]; then
    t0=$(date +%s)
    python3 -m bench.moe --model "$dir" --dtype float16 --prefix "$P" --continuation "$C" --stock > "$out/$shape-engine.log" 2>&1
    echo "-- A: bench.moe rc $? in $(( $(date +%s) - t0 )) s"
    log_filter < "$out/$shape-engine.log" | tail -12
    t0=$(date +%s)  # the routing statistics beside the published figures, on the GPU
    pb model stats "$dir" --dtype float16 --device "$DEV" --prefix 256 --count 2 --figure "$out/$shape-routing.svg" > "$out/$shape-stats.txt" 2> "$out/$shape-stats.err"
    echo "-- A: model stats rc $? in $(( $(date +%s) - t0 )) s"; grep -A8 "^published" "$out/$shape-stats.txt"
  fi
  if [ "${ONLY:-B}" = B ] || [ -z "${ONLY:-}" ]; then
    cat > "$work/$shape.yaml" <<YAML
name: moe-$shape-$layers
model: {path: $dir}
dtype: float16
prompts: {generator: {seed: 0, count: 1}}
prefix_tokens: $P
continuation_tokens: $C
conditions:
  - {policy: dense-stream}
  - {policy: resident}
  - {policy: packet}
  - {name: packet-host, policy: packet, params: {gather: host}}
  - {policy: phase-switched}
reference: dense-stream
warmups: 1
allowance_mib: $ALLOW
gates: {faithfulness: {}}
YAML
    t0=$(date +%s)
    pb submit "$work/$shape.yaml" --wait > "$out/$shape-submit.log" 2>&1; echo "-- B: submit rc $? in $(( $(date +%s) - t0 )) s"
    pb audit latest >> "$out/$shape-submit.log" 2>&1; echo "   audit rc $?"
    verdict "$out/$shape-submit.log"
    grep -E "^(faithfulness|resources|capacity) |condition|decode" "$out/$shape-submit.log" | head -14
  fi
  rm -rf "$dir"  # the next shape's checkpoint needs the disk
done
moe_end
