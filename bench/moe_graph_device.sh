#!/usr/bin/env bash
# One device call (issue 44): the sync-free mapped expert gather and mode graph for MoE on the H200.
#   For a Qwen3-30B-A3B-shaped and a Mixtral-8x7B-shaped synthetic checkpoint in fp16 (routing
#   calibrated, drawn on the GPU; the real layer shapes with QWEN_LAYERS=12 of 48 and
#   MIXTRAL_LAYERS=4 of 32, as bench/moe_device.sh):
#   A. bench.moe, one process: dense-stream (the reference; it must reproduce itself first),
#      resident, packet {gather: device} eager, packet {gather: mapped} eager (`mapped`) and in
#      mode graph (`mapped-graph`: each layer's experts of a decode call captured), alternated
#      (each prompt rotates the order, after one warm-up episode each); every variant bit for bit
#      against dense-stream and dense-stream against stock transformers; decode ms/token, bytes
#      per token and each packet's floor (resident's decode + its bytes at the pinned copy rate
#      measured in the same run);
#   B. `packbench submit --wait` of a protocol in engine mode graph (dense-stream, resident,
#      packet device, packet mapped: the mapped gather captured, the others eager) under a
#      24 GiB allowance, then `packbench audit`;
#   then the CUDA tests of the mapped gather (tests/engine/test_moe_mapped.py -m gpu).
#   Last: a short table (condition, exact, decode ms, MB/token, x floor) per shape.
# Run from the project root with .whl carried:  bash bench/moe_graph_device.sh
# Logs under $OUT (or ./moe-graph-out); ONLY=A or ONLY=B runs one part; SHAPES="qwen" or "mixtral"
# runs one shape (two calls if one does not fit 10 minutes). A CPU dry run on tiny shapes, the
# protocol's model given as model.synth (the worker draws it):  TINY=1 bash bench/moe_graph_device.sh
set -uo pipefail
root=$PWD
out=${OUT:-$root/moe-graph-out}; mkdir -p "$out"
if [ -n "${TINY:-}" ]; then
  : "${MIXTRAL_LAYERS:=2}" "${ALLOWANCE_MIB:=256}" "${B_MODEL:=synth}"
fi
source bench/device_common.sh
moe_begin
B_MODEL=${B_MODEL:-path}
CONDS=dense-stream,resident,packet,mapped,mapped-graph
mapfile -t specs < <(moe_specs)
summary=$out/summary.txt; : > "$summary"
for spec in "${specs[@]}"; do
  set -- $spec; shape=$1; layers=$2; dir=$work/$shape
  moe_synth "$shape" "$layers" "$dir"
  if [ "${ONLY:-A}" = A ] || [ -z "${ONLY:-}" ]; then
    t0=$(date +%s)
    python3 -m bench.moe --model "$dir" --dtype float16 --prefix "$P" --continuation "$C" --conditions "$CONDS" \
      --stock > "$out/$shape-engine.log" 2>&1
    echo "-- A: bench.moe rc $? in $(( $(date +%s) - t0 )) s"
    log_filter < "$out/$shape-engine.log" | tail -16
    { echo "== $shape ($layers layers), bench.moe:"
      grep -E "^(dense-stream|resident|packet|mapped|condition|floor|stock)" "$out/$shape-engine.log"; } >> "$summary"
  fi
  if [ "${ONLY:-B}" = B ] || [ -z "${ONLY:-}" ]; then
    if [ "$B_MODEL" = synth ]; then model="{synth: {shape: $shape, dtype: float16, seed: 0, layers: $layers}}"
    else model="{path: $dir}"; fi
    cat > "$work/$shape.yaml" <<YAML
name: moe-graph-$shape-$layers
model: $model
dtype: float16
prompts: {generator: {seed: 0, count: 1}}
prefix_tokens: $P
continuation_tokens: $C
engine: {mode: graph}
conditions:
  - {policy: dense-stream}
  - {policy: resident}
  - {name: packet, policy: packet, params: {gather: device}}
  - {name: mapped, policy: packet, params: {gather: mapped}}
reference: dense-stream
warmups: 1
allowance_mib: $ALLOW
gates: {faithfulness: {}}
YAML
    pb protocol validate "$work/$shape.yaml" > "$out/$shape-submit.log" 2>&1 || { echo "-- B: protocol invalid"; cat "$out/$shape-submit.log"; }
    t0=$(date +%s)
    pb submit "$work/$shape.yaml" --wait >> "$out/$shape-submit.log" 2>&1; echo "-- B: submit rc $? in $(( $(date +%s) - t0 )) s"
    pb audit latest >> "$out/$shape-submit.log" 2>&1; echo "   audit rc $?"
    grep -iE "^(faithfulness|resources|capacity) |^audit|agree" "$out/$shape-submit.log" | head -12
    { echo "== $shape ($layers layers), submit (engine mode graph) + audit:"
      grep -E "^(faithfulness|resources) +[^ ]+ +(exact|approximate) " "$out/$shape-submit.log" | head -8
      grep -iE "^audit|agree|differ" "$out/$shape-submit.log" | head -2; } >> "$summary"
  fi
  rm -rf "$dir"  # the next shape's checkpoint needs the disk
done
if [ -z "${TINY:-}" ] && [ -z "${SKIP_TESTS:-}" ]; then
  echo "== CUDA tests (the mapped gather)"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_moe_mapped.py > "$out/pytest.log" 2>&1
  echo "pytest rc $?"; grep -E "passed|failed|Error" "$out/pytest.log" | tail -4 | tee -a "$summary"
fi
moe_end
echo; echo "==== summary"; cat "$summary"
