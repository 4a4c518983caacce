#!/usr/bin/env bash
# One device call: honest CUDA screens audited end to end, so every field only a GPU run fills
# (device cuda:0, NVML energy and sampled peaks with their memory traces, pinned and context bytes,
# copy waits, graph mode, separate passes, zero-inference's pinned configuration, flexgen's policy,
# an expert cache's side-stream forecast with a trace of active sets) meets the auditor, then
# `results`, `compare`, `report` and `audit reexecute` read them. Each screen's audit verdict and
# first problem lines are printed. Carry .whl (EXTRA=offload). SUBMIT_TIMEOUT (140 s) bounds each screen.
# CPU dry run: SKIP_WHEELS=1 DEVICE=cpu NO_COMPETITORS=1 (python3 the venv's, PYTHONPATH the checkout).
set -uo pipefail
root=$PWD; out=${OUT:-$root/gpu-audit-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
command -v nvidia-smi >/dev/null && device_header
# the offload competitors (NO_COMPETITORS=1: none, the CPU dry run's) and flexgen's fidelity bound
competitors="  - {policy: zero-inference}
  - {policy: flexgen}
  - {policy: accelerate}"
fidelity="  fidelity: {max_mean_kl: 1.0, condition: flexgen}"
[ -z "${NO_COMPETITORS:-}" ] || competitors="" fidelity=""
opt() {  # name mode passes: an OPT screen of packbench's loaders and the offload competitors
  cat > "$work/$1.yaml" <<YAML
schema: 10
name: $1
model: {synth: {shape: opt-125m, dtype: float16, seed: 0}}
dtype: float16
prompts: {generator: {seed: 0, count: 2}}
prefix_tokens: 64
continuation_tokens: 8
conditions:
  - {policy: dense-stream}
  - {name: packet, policy: packet, params: {gather: device}}
  - {name: early-forecast, policy: early-forecast, params: {gather: device}}
  - {policy: resident}
$competitors
reference: dense-stream
warmups: 1
repetitions: 2
allowance_mib: 2048
engine: {mode: $2}
passes: $3
gates:
  faithfulness: {tolerance: 0.0}
  resources: {}
  capacity: {}
  acquisition: {control: dense-stream, max_ratio: 0.5}
  runtime: {control: dense-stream, max_ratio: 1.0}
$fidelity
YAML
}
moe() {
  cat > "$work/$1.yaml" <<YAML
name: $1
model: {synth: {shape: mixtral-tiny, dtype: float32, seed: 0}}
dtype: float32
prompts: {generator: {seed: 0, count: 2}}
prefix_tokens: 32
continuation_tokens: 8
conditions:
  - {policy: dense-stream}
  - {policy: packet}
  - {name: lru-2, policy: expert-cache, params: {capacity: 2}}
  - {policy: expert-forecast}
  - {name: lru-2-forecast, policy: expert-cache, params: {capacity: 2, forecast: "on"}}
reference: dense-stream
warmups: 1
allowance_mib: 1024
trace: true
gates: {faithfulness: {tolerance: 0.0}, resources: {}}
YAML
}
opt opt-eager eager together; opt opt-graph-separate graph separate; moe moe-traced
for s in opt-eager opt-graph-separate moe-traced; do
  t0=$(date +%s)
  timeout "${SUBMIT_TIMEOUT:-140}" python3 -m packbench submit "$work/$s.yaml" --wait > "$out/$s.log" 2>&1
  echo "== $s: submit rc $? in $(( $(date +%s) - t0 )) s"
  grep -E "^(error|  episode .* failed)" "$out/$s.log" | head -3 | cut -c1-300
  pb audit latest > "$out/$s-audit.log" 2>&1; echo "   audit rc $?"; verdict "$out/$s-audit.log"
done
echo "== readers"
pb results --screen 1 > "$out/results.txt" 2>&1; echo "results rc $?"
pb results --sort energy_j --desc --limit 3 2>&1 | tail -4
pb compare 1 2 > "$out/compare.txt" 2>&1; echo "compare rc $?"; grep -E "energy|peak_sampled|warning" "$out/compare.txt" | head -8
pb report 2 --out "$out/report2.html" 2>&1 | tail -1
pb history opt-eager > /dev/null 2>&1; echo "history rc $?"
python3 - "$work" <<'PY'
import sys, zipfile, json, glob
for z in sorted(glob.glob(sys.argv[1] + "/archives/*.zip")):
    with zipfile.ZipFile(z) as f:
        w = json.loads(f.read("worker.json"))
        rec = json.loads(f.read("episodes/00002.json"))
    print(z.rsplit("/", 1)[1][:22], w["start"].get("device"), "energy", rec.get("energy_j"),
          "memory", {k: rec["memory"].get(k) for k in ("peak_sampled_bytes", "pinned_bytes", "context_bytes")},
          "sampler", rec.get("sampler", {}).get("samples"))
PY
echo "== reexecute"
timeout 100 python3 -m packbench audit reexecute 1 --count 4 > "$out/reexecute.log" 2>&1; echo "reexecute rc $?"
tail -12 "$out/reexecute.log" | cut -c1-400
