#!/usr/bin/env bash
# One device call (issue 11): screens through the product's path (`submit --wait`, then audit).
#   1. seed-v0.40-shaped: synthetic OPT-2.7B fp16, 3 prompts x 32 + 16 tokens, 1 warmup, 4800 MiB,
#      dense-stream / packet (host gather) / packet (device gather), in engine mode eager, then graph.
#   2. bigger models (BIG_SHAPES, default opt-6.7b at 11264 MiB and opt-13b at 20480 MiB: the
#      non-FFN-out weights stay on the GPU): every offloading policy, 2 prompts x 128 + 16 tokens,
#      mode graph, the capacity gate with the others.
# Prints per screen and condition the median scored episode wall, and packet / dense-stream.
# Run from the project root with .whl carried: bash bench/scale_device.sh   (SKIP_13B=1 skips 2;
# a CPU dry run: SKIP_WHEELS=1 SHAPE27=tiny DTYPE=float32 BIG_SHAPES="tiny:1" bash bench/scale_device.sh;
# SKIP_V040=1 skips 1; V040_MODES=graph runs 1 in mode graph only; V040_REPEATS=3 runs each of its screens three times;
# V040_EXTRA="{...}" adds one condition to 1)
set -uo pipefail
[ -n "${SKIP_WHEELS:-}" ] || [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
source "$PWD/bench/device_common.sh"; work_dir; cd "$work"
export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives"
pb db upgrade >/dev/null
protocol() {  # name shape prompts prefix mode allowance conditions...
  local name=$1 model=$2 count=$3 prefix=$4 mode=$5 allowance=$6; shift 6
  { echo "name: $name"; echo "model: {path: $model}"; echo "dtype: ${DTYPE:-float16}"
    echo "prompts: {generator: {seed: 0, count: $count}}"; echo "prefix_tokens: $prefix"; echo "continuation_tokens: 16"
    echo "conditions:"; for c in "$@"; do echo "  - $c"; done
    echo "reference: dense-stream"; echo "warmups: 1"; echo "allowance_mib: $allowance"
    [ "$mode" = graph ] && echo "engine: {mode: graph}"
    echo "gates:"; echo "  faithfulness: {tolerance: 0.0}"; echo "  resources: {}"; echo "  capacity: {}"
    echo "  acquisition: {control: dense-stream, max_ratio: 0.5}"; } > "$name.yaml"
}
summary() {
python3 - <<'PY'
import statistics
from packbench.db.store import Store
s = Store()
for screen in s.list_screens():
    a = s.latest_attempt(screen.id)
    if a is None:
        continue
    eps = [e for e in s.episodes(a.id) if e.role == "scored" and e.status == "ok"]
    walls = {}
    for e in eps:
        walls.setdefault(e.condition, []).append(e.wall_s)
    med = {c: statistics.median(w) for c, w in walls.items()}
    faith = all(v.passed for v in s.verdicts(a.id) if v.gate == "faithfulness")
    line = ", ".join(f"{c} {m * 1e3:.1f} ms" + (f" ({m / med['dense-stream']:.3f} of dense)" if 'dense-stream' in med and c != 'dense-stream' else "")
                     for c, m in sorted(med.items()))
    h2d = {c: statistics.median([e.h2d_weight_bytes + e.h2d_index_bytes for e in eps if e.condition == c]) for c in walls}
    print(f"screen {screen.id} {screen.protocol}: {a.status}, faithfulness all pass {faith}; median episode wall: {line}")
    print(f"   median H2D bytes per episode: " + ", ".join(f"{c} {b:,.0f}" for c, b in sorted(h2d.items())))
PY
}
if [ -z "${SKIP_V040:-}" ]; then
t0=$(date +%s)
pb model synth --shape ${SHAPE27:-opt-2.7b} --dtype float16 --sparsity 0.94 --seed 0 --hot-fraction 0.05 --out m27 >/dev/null
echo "synth opt-2.7b: $(( $(date +%s) - t0 )) s"
C=("{policy: dense-stream}" "{policy: packet, params: {gather: host}}" "{name: packet-device, policy: packet, params: {gather: device}}")
[ -n "${V040_EXTRA:-}" ] && C+=("$V040_EXTRA")  # one more condition, e.g. "{name: forecast-device, policy: early-forecast, params: {gather: device}}"
screens=()
for mode in ${V040_MODES:-eager graph}; do  # V040_REPEATS=N: N screens per mode (names -1..-N; one screen each by default)
  for r in $(seq 1 ${V040_REPEATS:-1}); do
    name=v040-$mode; [ "${V040_REPEATS:-1}" -gt 1 ] && name=$name-$r
    protocol $name m27 3 32 $mode 4800 "${C[@]}"; screens+=($name)
  done
done
for p in "${screens[@]}"; do
  t=$(date +%s); pb submit $p.yaml --wait > $p.log 2>&1; echo "$p: rc $? in $(( $(date +%s) - t )) s"; grep -E "^(gate|faithfulness|acquisition|resources)" $p.log | tr -s ' ' | head -12
done
pb audit --all 2>&1 | grep -E "^audit of"
summary
fi
if [ -z "${SKIP_13B:-}" ]; then
  # Bigger models, where offloading is the only way: every offloading policy (resident cannot
  # run under an allowance below the model), 2 prompts x 128 + 16 tokens, mode graph, allowances
  # that hold everything but the outgoing FFN weights (12.4 GiB and 24.0 GiB models).
  BIG=("{policy: dense-stream}" "{policy: sparse-extents}" "{policy: packet}" "{name: packet-host, policy: packet, params: {gather: host}}"
       "{policy: phase-switched}" "{policy: row-retention, params: {rows_per_layer: 1024}}" "{policy: early-forecast}")
  for spec in ${BIG_SHAPES:-opt-6.7b:11264 opt-13b:20480}; do
    shape=${spec%%:*} allowance=${spec##*:}
    t0=$(date +%s)
    pb model synth --shape $shape --dtype ${DTYPE:-float16} --sparsity 0.94 --seed 0 --hot-fraction 0.05 --out m-$shape >/dev/null
    echo "synth $shape: $(( $(date +%s) - t0 )) s; $(du -sh m-$shape | cut -f1)"
    protocol big-$shape m-$shape 2 128 graph $allowance "${BIG[@]}"
    t=$(date +%s); timeout 300 python3 -m packbench submit big-$shape.yaml --wait > big-$shape.log 2>&1; echo "big-$shape: rc $? in $(( $(date +%s) - t )) s"
    grep -E "^(gate|faithfulness|acquisition|resources|capacity)|error" big-$shape.log | tr -s ' ' | head -30
    pb audit latest 2>&1 | grep -E "^audit of"
    summary | grep -A1 "big-$shape"
    rm -rf m-$shape  # the next model's disk
  done
fi
[ -n "${OUT:-}" ] && cp "$work"/*.log "$OUT"/ 2>/dev/null; true
