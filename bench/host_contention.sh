#!/usr/bin/env bash
# One device call on a one-GPU machine (issue 13's proxy): does a second worker's host gathering
# slow this worker's host-gathering policies, and do disjoint cores (PACKBENCH_WORKER_PIN) or
# sleeping OMP threads (OMP_WAIT_POLICY=PASSIVE) stop it? A second worker would share the one
# GPU here, so bench/host_noise.py stands in for its host side alone. The victim is bench.engine
# on the issue's screen shape (synthetic opt-1.3b fp16, 3 prompts x 512 + 16 tokens), with half
# the host's cores as threads, as a worker on a host of two GPUs gets. Arms alternate by round.
# Then, with .whl carried and PRODUCT=1, the every-policy screen through the product's path
# (submit --wait, audit) in engine mode graph.
# Usage (project root): [ROUNDS=2] [CONDITIONS=...] [PRODUCT=1] bash bench/host_contention.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
source "$(dirname "$0")/device_common.sh"; device_header
cores=$(nproc); half=$((cores / 2))
low="0-$((half - 1))"; high="$half-$((cores - 1))"
shape=${SHAPE:-opt-1.3b}
conditions=${CONDITIONS:-"packet,row-retention,early-forecast,packet+gather=device"}
victim() {  # $1: arm name, rest: a prefix for the victim's command (taskset ...)
  local name=$1; shift
  OMP_NUM_THREADS=$half timeout 200 "$@" python3 -m bench.engine --shape "$shape" --dtype float16 --prefix "${PREFIX:-512}" \
    --continuation "${CONT:-16}" --rounds 1 --conditions "$conditions" ${DEVICE_ARGS:-} > "$out/victim.log" 2>&1 \
    || echo "$name: victim rc $?"
  python3 - "$name" "$out/victim.log" >> "$out/arms.txt" <<'PY'
import sys
arm, table = sys.argv[1], 0
for line in open(sys.argv[2]):
    cells = line.split()
    if cells[:1] == ["condition"]:
        table += 1  # the first table's 2nd column is decode ms, the second's "episode s" its 6th
    elif table and len(cells) > 6 and cells[1].replace(".", "").isdigit():
        print(arm, cells[0], "decode_ms" if table == 1 else "episode_s", cells[1] if table == 1 else cells[5])
PY
}
noisy() {  # $1: arm name, $2: victim prefix, $3: noise prefix; a host_noise runs beside the victim
  local noise_pid
  OMP_NUM_THREADS=$half $3 python3 -m bench.host_noise --shape $shape > "$out/noise.log" 2>&1 & noise_pid=$!
  sleep 3
  victim "$1" $2
  kill -TERM $noise_pid; wait $noise_pid; echo "$1: $(tail -1 "$out/noise.log")"
}
: > "$out/arms.txt"
python3 -m bench.engine --shape "$shape" --dtype float16 --prefix 8 --continuation 2 --rounds 1 \
  --conditions packet ${DEVICE_ARGS:-} > /dev/null 2>&1  # synthesise the checkpoint and warm the caches
echo "== $cores cores: victim threads $half; pinned halves $low / $high"
for round in $(seq "${ROUNDS:-2}"); do
  victim alone
  noisy shared "" ""
  noisy pinned "taskset -c $low" "taskset -c $high"
  OMP_WAIT_POLICY=PASSIVE noisy passive "" ""
done
echo "== median over rounds, and against the victim alone (arm: condition ...)"
python3 - "$out/arms.txt" <<'PY'
import collections, statistics, sys
by = collections.defaultdict(list)
for line in open(sys.argv[1]):
    arm, cond, what, value = line.split()
    by[(what, arm, cond)].append(float(value))
for what in ("decode_ms", "episode_s"):
    arms = list(dict.fromkeys(a for w, a, _ in by if w == what))
    conds = list(dict.fromkeys(c for w, _, c in by if w == what))
    print(f"{what:8} " + " ".join(f"{c:>22}" for c in conds))
    for a in arms:
        base = [statistics.median(by[(what, "alone", c)]) for c in conds]
        row = [statistics.median(by[(what, a, c)]) for c in conds]
        print(f"{a:8} " + " ".join(f"{r:>13.3f} ({r / b:4.2f}x)" for r, b in zip(row, base)))
PY
if [ -n "${PRODUCT:-}" ]; then
  echo "== the every-policy screen through submit --wait and audit (mode graph)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled
  root=$PWD; work_dir; cd "$work"; source "$root/bench/every_policy.sh"
  export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives"
  MODE=graph every_policy_screen product-opt-1.3b
  python3 -m packbench db upgrade > /dev/null
  t=$(date +%s); python3 -m packbench submit p.yaml --wait > submit.log 2>&1; echo "submit --wait rc $? in $(( $(date +%s) - t )) s"
  grep -E "faithfulness|acquisition|screen 1" submit.log | head -12
  python3 -m packbench audit 1 2>&1 | grep -E "^audit of|AGREE|DISAGREE" | head -3
  cd "$root"
fi
date -u
