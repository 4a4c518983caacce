#!/usr/bin/env bash
# One device call: the competitor screen on a calibrated profile, opt4 by default (the synthetic OPT whose response to int4
# per-channel and group-128 weight quantization is calibrated to real OPT's, docs/workloads.md
# "Robustness"), through `packbench submit --wait` and `packbench audit`, then the frontier and the
# fidelity verdicts (bench/frontier.py). bench/competitors_device.sh with these defaults: SHAPE opt-2.7b
# (ALLOWANCE 4800 MiB; opt-13b: 20480), PROMPTS=1 x 512 + 16, the low-bit methods in their fastest
# modes (int8 and int4 weight-only and nf4 compiled), exact packets and resident beside them,
# accelerate and the CUDA tests left out (they do not depend on the profile), DEADLINE 540 s.
# Carry .whl built with EXTRA="torchao bitsandbytes" (bitsandbytes for nf4 and llm-int8):
#   bash bench/competitors_opt3_device.sh
#   SHAPE=opt-13b bash bench/competitors_opt3_device.sh     (a second call: 13b's checkpoint alone takes minutes)
# Any knob of competitors_device.sh passes through (METHODS, PER_METHOD, SKIP_INT8_PACKETS, ...).
# CPU dry run: SKIP_WHEELS=1 SHAPE=tiny PREFIX=32 METHODS=int8-weight-only:eager ENGINE_MODE=eager bash bench/competitors_opt3_device.sh
set -uo pipefail
export PROFILE=${PROFILE:-opt4} SHAPE=${SHAPE:-opt-2.7b} PROMPTS=${PROMPTS:-1} DEADLINE=${DEADLINE:-540}
export METHODS=${METHODS:-int8-weight-only int4-weight-only nf4}
export SKIP_ACCELERATE=${SKIP_ACCELERATE-1} SKIP_TESTS=${SKIP_TESTS-1}
[ "$SHAPE" = opt-13b ] && export ALLOWANCE=${ALLOWANCE:-20480}
export OUT=${OUT:-$PWD/competitors-opt3-out}
echo "== competitors on profile $PROFILE, $SHAPE: $METHODS"
bash bench/competitors_device.sh
