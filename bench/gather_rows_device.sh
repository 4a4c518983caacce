#!/usr/bin/env bash
# One device call (issue 26, target 2): the packet device gather copying each active row in one
# load (`+rows=whole`, engine/gather.py ROWS) against the tiled copy, alternated in one
# bench.engine run on the calibrated checkpoint, after the kernel's CUDA tests (both forms
# bit-for-bit against the reference); then bench.step_profile's GPU time per decode call.
#   SHAPE=opt-2.7b ALLOWANCE=4800 bash bench/gather_rows_device.sh
set -uo pipefail
root=$PWD; out=${OUT:-$root/gather-rows-out}; mkdir -p "$out"
source bench/device_common.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
device_header
shape=${SHAPE:-opt-2.7b}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gather.py > "$out/pytest.log" 2>&1
echo "gather CUDA tests rc $?: $(tail -1 "$out/pytest.log")"
p="packet+gather=device+mode=graph"
timeout 330 python3 -m bench.engine --shape "$shape" --dtype float16 --profile opt --prefix 512 --continuation 16 \
  --rounds "${ROUNDS:-3}" --allowance-mib "${ALLOWANCE:-4800}" \
  --conditions "$p,$p+rows=whole,$p+rows=whole+tile=16:128:4,$p+rows=whole+tile=32:128:8,$p+tile=32:256:8,resident+unbounded=yes+mode=graph" \
  > "$out/rows.log" 2>&1; echo "bench.engine rc $?"
grep -v -i warn "$out/rows.log" | tail -20
timeout 100 python3 -m bench.step_profile --shape "$shape" --dtype float16 --profile opt --out "$out" \
  --conditions "resident,packet+gather=device,packet+gather=device+rows=whole" > "$out/profile.log" 2>&1
echo "step_profile rc $?"; grep -v -i warn "$out/profile.log" | tail -8
