#!/usr/bin/env bash
# One device call (issue 48): the offloading peers beside exact packets through `packbench submit
# --wait` and `packbench audit`, calibrated synthetic OPT (SHAPE, default opt-2.7b, fp16, profile
# opt; PROMPTS x 512 + 16) under ALLOWANCE (default 4800 MiB, the packets' allowance): packet
# (device gather), dense-stream, accelerate and zero-inference (DeepSpeed ZeRO-3, parameters in
# pinned host memory, DeepSpeed's ZeRO-Inference settings), packbench's loaders in engine mode graph,
# every competitor in its one mode (eager). Then FlexGen's probe (bench/flexgen_probe.py) on the
# same checkpoint: it runs or prints its exact error. Budget: one call under 10 minutes (DEADLINE).
# Carry .whl, built here first (deepspeed is an sdist, built against the local torch):
#   pip wheel --no-build-isolation --no-deps deepspeed==0.19.8 -w .whl
#   EXTRA="hjson py-cpuinfo ninja einops msgpack psutil pydantic pydantic-core annotated-types typing-inspection typing-extensions flexgen==0.1.8 pulp attrs" bash ../shared/device/wheelhouse.sh
#   bash bench/peers_device.sh      (run with carry [".whl"])
set -uo pipefail
root=$PWD; out=${OUT:-$root/peers-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
# The peers' wheels even on a warm machine whose /tmp/site already holds ray (install_wheels skips then).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v '/ray-') 2>&1 | tail -2
python3 -c "import deepspeed" 2>&1 | tail -1  # DeepSpeed's import-time needs, shown before the screen
device_header | tee "$out/header.txt"
start=$(date +%s)
cat > "$work/peers.yaml" <<YAML
name: peers
model: {synth: {shape: ${SHAPE:-opt-2.7b}, dtype: float16, seed: 0, profile: opt}}
dtype: float16
prompts: {generator: {seed: 0, count: ${PROMPTS:-2}}}
prefix_tokens: 512
continuation_tokens: 16
conditions:
  - {name: dense-stream, policy: dense-stream}
  - {name: packet, policy: packet, params: {gather: device}}
  - {name: accelerate, policy: accelerate}
  - {name: zero-inference, policy: zero-inference}
reference: dense-stream
warmups: 1
allowance_mib: ${ALLOWANCE:-4800}
engine: {mode: graph}
gates:
  faithfulness: {tolerance: 0.0}
  resources: {}
YAML
timeout "${SCREEN_TIMEOUT:-420}" python3 -m packbench submit "$work/peers.yaml" --wait > "$out/peers.log" 2>&1
echo "== peers: submit rc $? in $(( $(date +%s) - start )) s"
pb audit latest >> "$out/peers.log" 2>&1; echo "   audit rc $?"
grep -E "^(faithfulness|resources) |audit of|error" "$out/peers.log" | sort -u | head -20
pb results --screen latest --json > "$out/peers.json" 2>/dev/null
python3 - <<'PY'  # per condition: steady decode (median per call), TTFT, bytes/token, peak, tier
import statistics
from packbench.db.store import Store
s, n = Store(), 15
med = lambda xs: statistics.median(xs) if xs else float("nan")
for screen in s.list_screens():
    a = s.latest_attempt(screen.id)
    print(f"screen {screen.id}: {a.status}")
    by = {}
    for e in s.episodes(a.id):
        if e.status != "ok":
            print(f"  episode {e.plan_index} {e.condition} failed: {(e.error or '')[:400]}")
        if e.role == "scored":
            by.setdefault(e.condition, []).append(e)
    print(f"  {'condition':16} {'ok':>3} {'TTFT ms':>8} {'decode ms/tok':>13} {'MB/token':>9} {'peak MiB':>9} tier")
    for c, eps in by.items():
        ok = [x for x in eps if x.status == "ok"]
        print(f"  {c:16} {len(ok):>3} {med([(x.prefill_call_s or 0) * 1e3 for x in ok]):>8.1f} "
              f"{med([(x.decode_call_s or 0) / n * 1e3 for x in ok]):>13.2f} "
              f"{med([(x.decode_h2d_bytes or 0) / n / 1e6 for x in ok]):>9.1f} "
              f"{max([(x.peak_sampled_bytes or 0) for x in ok], default=0) / 2**20:>9.0f} {getattr(ok[0], 'tier', '') if ok else ''}")
PY
ck=$(ls -d "$PACKBENCH_MODEL_CACHE"/*/ 2>/dev/null | head -1)
left=$(( ${DEADLINE:-560} - ($(date +%s) - start) ))
[ "$left" -gt 40 ] && [ -n "$ck" ] && timeout "$left" python3 -m bench.flexgen_probe "$ck" --shape "${SHAPE:-opt-2.7b}" \
  --allowance-mib "${ALLOWANCE:-4800}" 2> "$out/flexgen.err" | tee "$out/flexgen.json"
