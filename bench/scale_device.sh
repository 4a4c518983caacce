#!/usr/bin/env bash
# One device call (issue 11): screens through the product's path (`submit --wait`, then audit).
#   1. seed-v0.40-shaped: synthetic OPT-2.7B fp16, 3 prompts x 32 + 16 tokens, 1 warmup, 4800 MiB,
#      dense-stream / packet (host gather) / packet (device gather), in engine mode eager, then graph.
#   2. 13B-class: synthetic OPT-13B fp16, 2 prompts x 128 + 16 tokens, dense-stream / packet
#      (device gather), mode graph, allowance 24000 MiB (the non-FFN-out weights stay on the GPU).
# Prints per screen and condition the median scored episode wall, and packet / dense-stream.
# Run from the project root with .whl carried: bash bench/scale_device.sh   (SKIP_13B=1 skips 2;
# V040_MODES=graph runs 1 in mode graph only)
set -uo pipefail
[ -n "${SKIP_WHEELS:-}" ] || [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
pb() { python3 -m cli "$@"; }
work=$(mktemp -d); cd "$work"
export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives"
pb db upgrade >/dev/null
protocol() {  # name shape prompts prefix mode allowance conditions...
  local name=$1 model=$2 count=$3 prefix=$4 mode=$5 allowance=$6; shift 6
  { echo "name: $name"; echo "model: {path: $model}"; echo "dtype: float16"
    echo "prompts: {generator: {seed: 0, count: $count}}"; echo "prefix_tokens: $prefix"; echo "continuation_tokens: 16"
    echo "conditions:"; for c in "$@"; do echo "  - $c"; done
    echo "reference: dense-stream"; echo "warmups: 1"; echo "allowance_mib: $allowance"
    [ "$mode" = graph ] && echo "engine: {mode: graph}"
    echo "gates:"; echo "  faithfulness: {tolerance: 0.0}"; echo "  resources: {}"
    echo "  acquisition: {control: dense-stream, max_ratio: 0.5}"; } > "$name.yaml"
}
summary() {
python3 - <<'PY'
import statistics
from db.store import Store
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
t0=$(date +%s)
pb model synth --shape ${SHAPE27:-opt-2.7b} --dtype float16 --sparsity 0.94 --seed 0 --hot-fraction 0.05 --out m27 >/dev/null
echo "synth opt-2.7b: $(( $(date +%s) - t0 )) s"
C=("{policy: dense-stream}" "{policy: packet, params: {gather: host}}" "{name: packet-device, policy: packet, params: {gather: device}}")
protocol v040-eager m27 3 32 eager 4800 "${C[@]}"
protocol v040-graph m27 3 32 graph 4800 "${C[@]}"
for p in $(printf "v040-%s " ${V040_MODES:-eager graph}); do
  t=$(date +%s); pb submit $p.yaml --wait > $p.log 2>&1; echo "$p: rc $? in $(( $(date +%s) - t )) s"; grep -E "^(gate|faithfulness|acquisition|resources)" $p.log | tr -s ' ' | head -12
done
pb audit --all 2>&1 | grep -E "^audit of"
summary
if [ -z "${SKIP_13B:-}" ]; then
  t0=$(date +%s)
  pb model synth --shape opt-13b --dtype float16 --sparsity 0.94 --seed 0 --hot-fraction 0.05 --out m13b >/dev/null
  echo "synth opt-13b: $(( $(date +%s) - t0 )) s; $(du -sh m13b | cut -f1)"
  protocol opt13b-graph m13b 2 128 graph 24000 "{policy: dense-stream}" "{name: packet-device, policy: packet, params: {gather: device}}"
  t=$(date +%s); timeout 300 python3 -m cli submit opt13b-graph.yaml --wait > 13b.log 2>&1; echo "opt13b-graph: rc $? in $(( $(date +%s) - t )) s"
  grep -E "^(faithfulness|acquisition|resources)|error" 13b.log | tr -s ' ' | head -8
  pb audit latest 2>&1 | grep -E "^audit of"
  summary | grep -A1 opt13b
fi
