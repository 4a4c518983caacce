#!/usr/bin/env bash
# One device call (issue 23): the seed's real-OPT rows re-measured on the calibrated profile, every
# policy's exactness with it, and the seed's v0.40 / v0.42 screens through the product.
#   A. bench.engine, synthetic checkpoints of profile `opt` (docs/workloads.md):
#      1. OPT-2.7B fp16, 3 prompts x 512 + 16 tokens, every policy (decode / prefill rows, exact)
#      2. OPT-2.7B fp16, 3 prompts x 32 + 16 (v0.40: episode packets / dense-stream)
#      3. OPT-1.3B fp32, 3 prompts x 32 + 16 (v0.38: early-forecast against packet)
#   B. protocols/seed-v040.yaml and seed-v042.yaml through `packbench submit --wait`, then audit.
# Full logs under $OUT (or ./workloads-out); the tables last. Run from the project root with .whl
# carried: bash bench/workloads_device.sh   (ONLY=A or ONLY=B runs one part; a CPU dry run:
# SKIP_WHEELS=1 SHAPE27=tiny SHAPE13=tiny PREFIX=64 ONLY=A bash bench/workloads_device.sh; PROFILE=opt2 for part A on
# that profile)
set -uo pipefail
root=$PWD
out=${OUT:-$root/workloads-out}; mkdir -p "$out"
[ -n "${SKIP_WHEELS:-}" ] || [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$root RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
source bench/device_common.sh
command -v nvidia-smi >/dev/null && device_header
S27=${SHAPE27:-opt-2.7b}; S13=${SHAPE13:-opt-1.3b}; P=${PREFIX:-512}
engine() {  # log-name args...: the run's whole output in $out, its workload lines here
  local name=$1; shift
  python3 -m bench.engine --profile "${PROFILE:-opt}" --prompts 3 --rounds 1 --continuation 16 "$@" > "$out/$name.log" 2>&1
  echo "== $name (rc $?): $*"
  grep -E "reproduces itself|^  [a-z-]+.*: decode|exact$| True| False" "$out/$name.log" | grep -vE "^(condition|pinned)" | tail -14
}
if [ "${ONLY:-A}" = A ] || [ -z "${ONLY:-}" ]; then
  engine a1-2.7b-512 --shape "$S27" --dtype float16 --prefix "$P" \
    --conditions "dense-stream,resident+unbounded=yes,packet,packet+gather=device,sparse-extents,phase-switched,row-retention+rows_per_layer=512,early-forecast,early-forecast+gather=device"
  engine a2-2.7b-32 --shape "$S27" --dtype float16 --prefix 32 --conditions "dense-stream,packet,packet+gather=device,phase-switched"
  engine a3-1.3b-32 --shape "$S13" --dtype float32 --prefix 32 --conditions "dense-stream,packet,early-forecast" --allowance-mib 12000
fi
if [ "${ONLY:-B}" = B ] || [ -z "${ONLY:-}" ]; then
  work_dir
  export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives" PACKBENCH_MODEL_CACHE="$work/models"
  pb() { python3 -m packbench "$@"; }
  pb db upgrade > /dev/null
  for name in seed-v040 seed-v042; do
    src=$root/protocols/$name.yaml
    [ "$S27" = opt-2.7b ] || { sed "s/opt-2.7b/$S27/; s/float16/float32/g" "$src" > "$work/$name.yaml"; src=$work/$name.yaml; }
    t0=$(date +%s)
    pb submit "$src" --wait > "$out/$name.log" 2>&1; echo "== $name: submit rc $? in $(( $(date +%s) - t0 )) s"
    pb audit latest >> "$out/$name.log" 2>&1; echo "   audit rc $?"
    grep -E "^(faithfulness|acquisition|runtime|resources|capacity) " "$out/$name.log" | head -12
  done
  python3 -m bench.seed_screens | tee "$out/seed_screens.txt"
  cp -r "$work/archives" "$out/" 2>/dev/null
fi
