#!/usr/bin/env bash
# One device call (issue 26, targets 2 and 5): where a packet decode token's time goes
# (bench/step_profile.py: kernels by kind and idle time per call, beside resident's), then the
# measurement's own cost (bench.engine: the ledger and the NVML sampler's memory and energy
# readings on and off, alternated in one run). No wheels needed:
#   bash bench/gaps_device.sh
set -uo pipefail
root=$PWD; out=${OUT:-$root/gaps-out}; mkdir -p "$out"
source bench/device_common.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
device_header
shape=${SHAPE27:-opt-2.7b}
echo "== decode gaps"
timeout 280 python3 -m bench.step_profile --shape "$shape" --dtype float16 --profile opt --prefix "${PREFIX:-512}" \
  --out "$out" --conditions "resident,packet+gather=device,packet+gather=device+tile=32:256:8,dense-stream" \
  > "$out/gaps.log" 2>&1; echo "decode_gaps rc $?"
cat "$out/gaps.log" | grep -v Warning | tail -40
echo "== recording cost"
p="packet+gather=device+mode=graph"; d="dense-stream+mode=graph"; r="resident+unbounded=yes+mode=graph"
timeout 280 python3 -m bench.engine --shape "$shape" --dtype float16 --profile opt --prefix "${PREFIX:-512}" \
  --continuation 16 --rounds "${ROUNDS:-3}" --allowance-mib 4800 \
  --conditions "$p,$p+recording=off,$p+sampler=off,$p+recording=off+sampler=off,$d,$d+recording=off+sampler=off,$r,$r+recording=off+sampler=off" \
  > "$out/recording.log" 2>&1; echo "bench.engine rc $?"
grep -v Warning "$out/recording.log" | tail -30
