#!/usr/bin/env bash
# One device call (issue 11): the opt-13b decode table beside opt-2.7b and opt-6.7b
# (docs/experiments/engine.md). Synthetic OPT-13B fp16 (25.7 GB), 3 prompts x 512 + 16 tokens, 2 rounds
# alternated, mode graph, allowance 20480 MiB (the whole model, 24.0 GiB, does not fit; the
# CPU-first start keeps the 8.4 GB of outgoing FFN weights on the host). Full log in $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
date -u
timeout 560 python3 -m bench.engine --shape opt-13b --dtype float16 --prefix 512 --continuation 16 --rounds 2 \
  --allowance-mib 20480 --conditions "resident+unbounded=yes+mode=graph,dense-stream+mode=graph,packet+gather=device+mode=graph" \
  > "$out/bench13b.log" 2>&1; echo "rc $?"
grep -vE "^\s*$" "$out/bench13b.log" | grep -v "Loading weights" | tail -20 | cut -c1-200
date -u
