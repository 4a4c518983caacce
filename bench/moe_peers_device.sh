#!/usr/bin/env bash
# One device call per shape (issue 45, item 4): the MoE competitors beside exact expert packets on the H200.
#   A synthetic checkpoint of SHAPE (qwen3-30b-a3b, 12 of 48 layers, by default; mixtral-8x7b with
#   LAYERS=4 of 32), fp16, routing calibrated, drawn on the GPU, then:
#   A. bench.moe_peers: the crossover batch. At batches 1..64, dense-stream, `packet {gather: device}`,
#      `packet {gather: mapped}` (its own crossover) and host-experts (Fiddler-style, packbench's implementation; also with HOT experts a layer held on
#      the device, its hit rate printed): decode ms per call, prefill apart,
#      bytes per call each direction, cold (warm-up) apart from warm, packets bit-identical to
#      dense-stream and host-experts' fidelity at each batch; the first batch from which the packet
#      (moving the weights) decodes faster than computing the experts on the host;
#   B. one screen through `packbench submit --wait` and `packbench audit`: dense-stream, packet (host
#      gather), packet-mapped (`{gather: mapped}`), accelerate (its device_map offload, tier exact, judged by faithfulness) and host-experts (tier
#      approximate, judged by fidelity), every expert on the host and with a hot set of HOT experts a
#      layer on the device, 1 warm-up + 2 prompts each; then bench.moe_peers_screen on
#      its archive: TTFT and decode ms/token, tokens/s, bytes per decode token each direction,
#      experts per layer, tier and verdict, cold and warm apart.
#   The allowance puts about the share of the model on the device that 24 GiB puts of the full model
#   (Qwen3-30B-A3B fp16 57 GiB: 42 %; Mixtral-8x7B 87 GiB: 28 %): ALLOWANCE_MIB, default 7168 for
#   qwen3-30b-a3b at 12 layers (16.4 GiB) and 4608 for mixtral-8x7b at 4 layers (11.2 GiB), so that
#   accelerate offloads as it would at full depth (at 24 GiB the truncated models would fit whole).
# Run from the project root with .whl carried (ray, sqlalchemy, alembic: `bash ../shared/device/wheelhouse.sh`;
# accelerate is on the machine):
#   bash bench/moe_peers_device.sh                                    # Qwen3-30B-A3B-shaped
#   SHAPE=mixtral-8x7b LAYERS=4 bash bench/moe_peers_device.sh        # Mixtral-8x7B-shaped
# ONLY=A or ONLY=B runs one part. DEADLINE (s, default 560) bounds the call: part A stops at what is left
# less B_SHARE (s, default 300; B's screen, audit and summary) when B follows, less 15 s alone, and prints
# the batches it finished; B's screen stops 40 s before DEADLINE. Logs under $OUT (or ./moe-peers-out).
# A CPU dry run (a python3 with torch first on PATH, e.g. the shared venv's bin):
#   SKIP_WHEELS=1 DEVICE=cpu SHAPE=qwen3-moe-tiny LAYERS=3 ALLOWANCE_MIB=64 BATCHES=1,2 PREFIX=16 CONT=4 \
#   bash bench/moe_peers_device.sh
set -uo pipefail
t_start=$(date +%s)
DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - ($(date +%s) - t_start) )); }
root=$PWD
out=${OUT:-$root/moe-peers-out}; mkdir -p "$out"
source bench/device_common.sh
product_env
command -v nvidia-smi >/dev/null && device_header
DEV=${DEVICE:-cuda}; SHAPE=${SHAPE:-qwen3-30b-a3b}; LAYERS=${LAYERS:-12}
# HOT: experts a layer host-experts-hot holds on the device (Fiddler's GPU-resident popular experts):
# about 1.7 GiB at Qwen3 (16 x 9 MiB x 12 layers), 2.6 GiB at Mixtral (2 x 336 MiB x 4 layers).
case "$SHAPE" in mixtral-8x7b) ALLOW=${ALLOWANCE_MIB:-4608}; HOT=${HOT:-2};; *) ALLOW=${ALLOWANCE_MIB:-7168}; HOT=${HOT:-16};; esac
P=${PREFIX:-128}; C=${CONT:-16}; BATCHES=${BATCHES:-1,2,4,8,16,32,64}
dir=$work/$SHAPE
t0=$(date +%s)
pb model synth --out "$dir" --shape "$SHAPE" --dtype float16 --layers "$LAYERS" --device "$DEV" > "$out/synth.log" 2>&1
echo "== $SHAPE, $LAYERS layers: synth rc $? in $(( $(date +%s) - t0 )) s ($(du -sh "$dir" | cut -f1)); allowance $ALLOW MiB"
filter() { grep -vE "^W[0-9]|Warn|warn|Loading|Writing|output = func|torchao"; }
if [ "${ONLY:-A}" = A ]; then
  t0=$(date +%s); limit=$(( $(left) - 15 )); [ "${ONLY:-}" = A ] || limit=$(( $(left) - ${B_SHARE:-300} ))
  # decode is what the crossover is about: short prefixes keep host prefills of B x 16 tokens short
  [ "$limit" -ge 30 ] || limit=1  # too little left: A stops at once and says so, B keeps its share
  timeout "$limit" python3 -m bench.moe_peers --model "$dir" --dtype float16 --batches "$BATCHES" --prefix 16 \
    --continuation 8 --rounds 2 --hot "$HOT" > "$out/crossover.log" 2>&1
  rc=$?; echo "-- A: bench.moe_peers rc $rc in $(( $(date +%s) - t0 )) s (limit $limit s$([ $rc = 124 ] && echo \
    ": stopped there, the batches printed below finished; BATCHES fewer or ONLY=A for the rest"))"
  filter < "$out/crossover.log" | grep -E "warm|crossover|host-experts /|experts x" | tail -30
fi
if [ "${ONLY:-B}" = B ]; then
  cat > "$work/peers.yaml" <<YAML
name: moe-peers-$SHAPE-$LAYERS
model: {path: $dir}
dtype: float16
prompts: {generator: {seed: 0, count: 2}}
prefix_tokens: $P
continuation_tokens: $C
conditions:
  - {policy: dense-stream}
  - {policy: packet}
  - {name: packet-mapped, policy: packet, params: {gather: mapped}}
  - {policy: accelerate}
  - {policy: host-experts}
  - {name: host-experts-hot, policy: host-experts, params: {hot: $HOT}}
reference: dense-stream
warmups: 1
allowance_mib: $ALLOW
gates: {faithfulness: {}, fidelity: {max_mean_kl: 0.002, min_top1: 0.98}}
YAML
  t0=$(date +%s)
  limit=$(( $(left) - 40 )); [ "$limit" -ge 30 ] || limit=1  # the audit and the summary need the rest
  timeout "$limit" python3 -m packbench submit "$work/peers.yaml" --wait > "$out/submit.log" 2>&1
  echo "-- B: submit rc $? in $(( $(date +%s) - t0 )) s (limit $limit s)"
  pb audit latest > "$out/audit.log" 2>&1; echo "   audit rc $?"; tail -2 "$out/audit.log"
  archive=$(ls -t "$work"/archives/*.zip "$work"/archives/*/*.zip 2>/dev/null | head -1)
  if [ -n "$archive" ]; then python3 -m bench.moe_peers_screen "$archive" > "$out/screen.txt" 2>&1
  else echo "no archive: the screen did not start" > "$out/screen.txt"; false; fi; echo "   summary rc $?"
  grep -E "accelerate|offload" "$out/submit.log" | head -4
  cat "$out/screen.txt"
  # accelerate's placement per episode (what max_memory it was given, what the device already held),
  # and a failed episode's last traceback lines: the archive is too large to come back from a call
  [ -n "$archive" ] && python3 - "$archive" <<'PY'
import json, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for name in sorted(n for n in z.namelist() if n.startswith("episodes/") and n.endswith(".json")):
    r = json.loads(z.read(name))
    o = r.get("offload") or {}
    if o:
        keys = ("max_memory_bytes", "held_bytes", "device_bytes", "offloaded_bytes", "offloaded_modules")
        print(f"   offload {r.get('condition')} episode {r.get('plan_index')}: {json.dumps({k: o.get(k) for k in keys})}")
    if r.get("status") != "ok":
        tail = " | ".join((r.get("traceback") or "").strip().splitlines()[-4:])
        print(f"   failed {r.get('condition')} episode {r.get('plan_index')}: {tail[:600]}")
PY
fi
rm -rf "$dir"
cp -r "$work/archives" "$out/" 2>/dev/null
