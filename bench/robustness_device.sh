#!/usr/bin/env bash
# One device call: the synthetic profiles' response to weight quantization at the four real OPT
# shapes, beside real OPT's published figures (docs/workloads.md, "Robustness").
# Each shape is drawn on the host from the profile's seed (the same weights `model synth` writes),
# moved to the GPU in fp16, then 8 prompts x 128 generated tokens + 128 tokens it samples are
# teacher-forced through the fp16 model and each fake-quantized variant (bench/robustness.py).
# The four shapes run side by side (one process each), the profiles one after another in it.
# Full logs and JSON under $OUT (or ./robustness-out); the table last. Run from the project root
# with .whl carried:  bash bench/robustness_device.sh
#   PROFILES="opt4" (default; several: one after another in each shape's process, the first is the
#   table's ratio column; opt3 alone took 204 s on the H200, so two take about 410 s of the 570),
#   SHAPES="opt-1.3b opt-2.7b opt-6.7b
#   opt-13b", PROMPTS=8, PREFIX=128, SAMPLED=128, VARIANTS (comma-separated; default the four with
#   calibrated targets or an nf4 reference: int8-channel,int4-channel,int4-g128,nf4-b64; append
#   int3-channel,int3-g128 for the 3-bit rows of docs/workloads.md, "Beyond the targets"),
#   BUDGET_S=570 (what the runs may take in all).
#   A candidate beside the profile: PROFILES="opt3 opt3+salient=0:8+salient_count=4" (bench/robustness.py).
# CPU dry run: SKIP_WHEELS=1 DEVICE=cpu DTYPE=float32 SHAPES=tiny PROMPTS=2 PREFIX=16 SAMPLED=16 bash bench/robustness_device.sh
# The byte rows of docs/workloads.md on profile opt2: PROFILE=opt2 ONLY=A bash bench/workloads_device.sh
set -uo pipefail
root=$PWD
out=${OUT:-$root/robustness-out}; mkdir -p "$out"
source bench/device_common.sh
install_wheels
export RAY_AUTH_MODE=disabled
command -v nvidia-smi >/dev/null && device_header
shapes=${SHAPES:-opt-1.3b opt-2.7b opt-6.7b opt-13b}
profiles=${PROFILES:-opt4}
variants=${VARIANTS:-int8-channel,int4-channel,int4-g128,nf4-b64}
pids=()
start=$(date +%s)
for shape in $shapes; do
  (
    for profile in $profiles; do
      tag=$shape-${profile//[^A-Za-z0-9._-]/_}  # a candidate's + = : in no file name
      left=$(( start + ${BUDGET_S:-570} - $(date +%s) ))  # the call's 10 minutes: what is left of them
      [ "$left" -gt 30 ] || { echo "== $shape $profile skipped: ${left} s left"; continue; }
      timeout "$left" python3 -m bench.robustness --shape "$shape" --profile "$profile" --dtype "${DTYPE:-float16}" \
        --device "${DEVICE:-cuda}" --prompts "${PROMPTS:-8}" --prefix "${PREFIX:-128}" --sampled "${SAMPLED:-128}" \
        --variants "$variants" --json "$out/$tag.json" > "$out/$tag.log" 2>&1
      echo "== $shape $profile rc $?"; grep -E "dCE|drawn" "$out/$tag.log"
    done
  ) &
  pids+=($!)
done
wait "${pids[@]}"
files=()
for profile in $profiles; do for shape in $shapes; do
  tag=$shape-${profile//[^A-Za-z0-9._-]/_}; [ -f "$out/$tag.json" ] && files+=("$out/$tag.json")
done; done
echo; python3 -m bench.robustness table "${files[@]}" | tee "$out/table.md"
