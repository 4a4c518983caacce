#!/usr/bin/env bash
# One device call (issue 48): the offloading peers beside exact packets, through `packbench submit
# --wait` and `packbench audit`, on calibrated synthetic OPT (SHAPE, default opt-2.7b, fp16, PROFILE,
# default opt4: calibrated for bytes and for quantization, so flexgen's fidelity verdict means what
# it says): dense-stream (the reference), packet and phase-switched ({gather: device}, engine mode graph),
# accelerate and zero-inference (DeepSpeed ZeRO-3, parameters in pinned host memory, partitioned
# before deepspeed.initialize, prefetch bucket and live parameters from the allowance, reuse distance
# 0: engine/zero_inference.py ZeroBudget; its configuration is printed above the table) and flexgen
# (FlexGen's OptLM as a condition, tier approximate, judged by a fidelity gate: engine/flexgen.py),
# every competitor in its one mode (eager). Two screens: batch 1 (PROMPTS x PREFIX + 16, ALLOWANCE MiB: the latency configuration)
# and, per entry of BATCHES, batch B (B prompts x BATCH_PREFIX + 16, BATCH_ALLOWANCE MiB: the
# throughput configuration; docs/experiments/batched.md: per-token time falls with the batch up to
# the KV cache's limit, 32 x 64 tokens at 5700 MiB for opt-2.7b). Then FlexGen's probe
# (bench/flexgen_probe.py) on the same checkpoint at batch 1 and FLEXGEN_BATCHES: it runs or
# prints its exact error. A table last: one row per (screen, condition), the steady decode call
# (docs/metrics.md: the median decode call but each episode's first, one rule for every condition)
# per token per sequence, warm TTFT, bytes per decode call and per token, peaks, tier, faithfulness.
# Budget: one call under 10 minutes (DEADLINE seconds for the whole script, 560).
#
# Wheels (carry [".whl"], 56 MiB; built on the CPU machine, python 3.12 manylinux for the device):
#   pip wheel --no-build-isolation --no-deps deepspeed==0.19.8 -w .whl   # an sdist; pure Python, 2.1 MB
#   EXTRA="hjson py-cpuinfo ninja einops msgpack psutil pydantic pydantic-core annotated-types typing-inspection typing-extensions flexgen==0.1.8 pulp attrs" bash ../shared/device/wheelhouse.sh
#   (in a git worktree, whose .git is a file, run wheelhouse.sh from a folder holding .git/info/ with
#   WHEELHOUSE=<worktree>/.whl: it appends to .git/info/exclude)
#   bash bench/peers_device.sh
# Knobs: SHAPE, PROFILE (opt4), SCORED (1: scored batches a condition at batch > 1), BATCH_CONT (8: their continuation), PROMPTS (2), PREFIX (512), ALLOWANCE (4800), BATCHES ("32"; "" for none), BATCH_PREFIX (64),
# BATCH_ALLOWANCE (5700), CONDITIONS (the six names above; TINY: the five but flexgen), BATCH_CONDITIONS
# (the batched screens': CONDITIONS, else the five but flexgen), SKIP_B1 (no batch-1 screen), SKIP_FLEXGEN,
# FLEXGEN_BATCHES ("8,32"), PREDRAW (draw the checkpoint before each screen, timed), THEN_CONDITIONS (a second batched screen: below), PROBE_BATCHES (the probe's: "1,FLEXGEN_BATCHES"), SKIP_ZI_TEST (no zero-inference CUDA test), CONT (16), SCREEN_TIMEOUT (300), DEADLINE (560), RESERVE (30: kept
# after each screen, its predraw and the CUDA test for the audit and the table; a step with 30 s or less of its own left is skipped). A batch-B screen plans B
# scored episodes per condition (one starting at each prompt), so batch 32 is the long one: where one
# call cannot hold everything, split it (docs/experiments/competitors.md, "The H200 run"):
#   BATCHES= bash bench/peers_device.sh                          # batch 1 + FlexGen's sweep
#   SKIP_B1=1 SKIP_FLEXGEN=1 BATCHES="8 32" bash bench/peers_device.sh
#   SHAPE=opt-13b ALLOWANCE=20480 PROMPTS=1 BATCHES= SKIP_FLEXGEN=1 SKIP_ZI_TEST=1 SCREEN_TIMEOUT=250 DEADLINE=285 bash bench/peers_device.sh
#   (OPT-13B: the five exact conditions took 233 s at 1 x 512 + 16 and did not finish 2 prompts in 300 s)
# TINY=1: the same path on the CPU on tiny shapes (float32,
# 16-token prefixes, engine mode eager, 64 MiB allowances; no FlexGen, which needs CUDA), to check the
# script end to end where there is no GPU.
set -uo pipefail
start=$(date +%s)  # DEADLINE counts from here: the wheels' install and the imports below are the call's time too
root=$PWD; out=${OUT:-$root/peers-out}; mkdir -p "$out"
source bench/device_common.sh
if [ -n "${TINY:-}" ]; then  # the CPU check: the Python that runs the tests, deepspeed on its path
  SHAPE=${SHAPE:-tiny} DTYPE=float32 PREFIX=${PREFIX:-16} CONT=6 ALLOWANCE=${ALLOWANCE:-64}
  BATCHES=${BATCHES-2} BATCH_PREFIX=${BATCH_PREFIX:-16} BATCH_ALLOWANCE=${BATCH_ALLOWANCE:-64} MODE=eager SKIP_FLEXGEN=1
  work_dir; mkdir -p "$work/bin"; printf '#!/bin/sh\nexec %s "$@"\n' "${PYTHON:-$root/.venv/bin/python}" > "$work/bin/python3"
  chmod +x "$work/bin/python3"
  export PATH=$work/bin:$PATH PYTHONPATH=${TINY_PATH:+$TINY_PATH:}$root PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
  export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives" PACKBENCH_MODEL_CACHE="$work/models"
  python3 -m packbench db upgrade > /dev/null
else
  product_env
  # The peers' wheels even on a warm machine whose /tmp/site already holds ray (install_wheels skips then).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v '/ray-') 2>&1 | tail -2
  device_header | tee "$out/header.txt"
fi
SHAPE=${SHAPE:-opt-2.7b} DTYPE=${DTYPE:-float16} CONT=${CONT:-16} MODE=${MODE:-graph}
python3 -c "import deepspeed, transformers; print('deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" \
  2>&1 | tail -1  # DeepSpeed's import-time needs, shown before the screens
# flexgen runs on CUDA only (a CPU worker refuses the screen at load): not in TINY's default
peers="dense-stream packet phase-switched accelerate zero-inference"; [ -n "${TINY:-}" ] || peers="$peers flexgen"
conditions=${CONDITIONS:-$peers}
condition_line() {  # name -> its protocol entry
  case $1 in
    dense-stream) echo "  - {name: dense-stream, policy: dense-stream}" ;;
    packet) echo "  - {name: packet, policy: packet, params: {gather: device}}" ;;
    phase-switched) echo "  - {name: phase-switched, policy: phase-switched, params: {gather: device}}" ;;
    accelerate) echo "  - {name: accelerate, policy: accelerate}" ;;
    zero-inference) echo "  - {name: zero-inference, policy: zero-inference}" ;;
    # FlexGen's OptLM (engine/flexgen.py): placement chosen on the worker from the allowance
    # (core/conditions/flexgen.py choose_policy), written into every record as offload.policy
    flexgen) echo "  - {name: flexgen, policy: flexgen}" ;;
    *) echo "unknown condition $1" >&2; exit 2 ;;
  esac
}
within() {  # CAP: the seconds a step may run, CAP or what DEADLINE (560) leaves less RESERVE (30) if that is less
  local left=$(( ${DEADLINE:-560} - ($(date +%s) - start) - ${RESERVE:-30} ))
  echo $(( left < $1 ? left : $1 ))
}
screen() {  # name batch prompts prefix allowance
  local name=$1 batch=$2 prompts=$3 prefix=$4 allowance=$5
  { echo "name: $name"
    echo "model: {synth: {shape: $SHAPE, dtype: $DTYPE, seed: 0, profile: ${PROFILE:-opt4}}}"; echo "dtype: $DTYPE"
    echo "prompts: {generator: {seed: 0, count: $prompts}}"; echo "prefix_tokens: $prefix"; echo "continuation_tokens: $CONT"
    # A batch scores SCORED (1) batches of B prompts a condition, not B overlapping ones (protocol
    # schema 10): 32 x 32 sequences' logits put the first batch-32 screen's archive at 10 GB.
    [ "$batch" -gt 1 ] && echo "batch: $batch" && echo "scored_prompts: ${SCORED:-1}"
    echo "conditions:"
    for c in $conditions; do condition_line "$c"; done
    echo "reference: dense-stream"; echo "warmups: 1"; echo "allowance_mib: $allowance"
    echo "engine: {mode: $MODE}"  # packbench's loaders in their fastest mode; competitors in their own (eager)
    echo "gates:"; echo "  faithfulness: {tolerance: 0.0}"; echo "  resources: {}"
    # flexgen is approximate (its own kernels): judged by fidelity, teacher-forced on dense-stream's tokens
    case " $conditions " in *" flexgen "*) echo "  fidelity: {condition: flexgen, min_top1: 0.9}" ;; esac
  } > "$work/$name.yaml"
  # A screen whose archive `packbench audit` would refuse (over its bound: batch x tokens x episodes'
  # logits) is not run, its minutes would give no audited row: at batch 64 (OPT's vocabulary, five
  # conditions) BATCH_CONT=5 fits, 8 does not
  local over
  over=$(python3 -m packbench protocol plan "$work/$name.yaml" 2>&1 >/dev/null | grep "over the audit bound")
  [ -z "$over" ] || { echo "== $name: skipped, ${over#warning: } (BATCH_CONT, BATCH_CONDITIONS or SCORED set it)"; return; }
  local t0 limit
  limit=$(within "${SCREEN_TIMEOUT:-300}")
  [ "$limit" -gt 30 ] || { echo "== $name: skipped, $limit s left of DEADLINE less RESERVE"; return; }
  if [ -n "${PREDRAW:-}" ]; then  # the checkpoint drawn into the model cache here, timed (the worker then finds it)
    python3 - "$work/$name.yaml" <<'PY' 2>&1 | tail -2
import sys, time
from pathlib import Path
from packbench.core.protocol import expand
from packbench.core.protocol.freeze import load
from packbench.engine.worker import model_dir_for
import os, torch
t = time.time()
path = model_dir_for(expand(dict(load(Path(sys.argv[1])).body)), None, cache=Path(os.environ["PACKBENCH_MODEL_CACHE"]))
print(f"   predraw: {path.name} in {time.time() - t:.1f} s on {torch.get_num_threads()} threads")
PY
    # the draw has no limit of its own: what it left is checked again (`timeout 0` would never stop the
    # screen, a negative limit would not start it and the audit below would be the previous screen's)
    limit=$(within "$limit")
    [ "$limit" -gt 30 ] || { echo "== $name: skipped after its predraw, $limit s left of DEADLINE less RESERVE"; return; }
  fi
  t0=$(date +%s)
  # each log line stamped with the seconds since the submit began (where the screen's time went)
  timeout "$limit" python3 -m packbench submit "$work/$name.yaml" --wait 2>&1 \
    | while IFS= read -r line; do printf '%4d %s\n' $(( $(date +%s) - t0 )) "$line"; done > "$out/$name.log"
  echo "== $name (batch $batch, $prompts x $prefix + $CONT, $allowance MiB): submit rc ${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s (limit $limit s)"
  # the screen this submit ran, from its progress line: after a submit refused or stopped before its screen
  # started, `audit latest` and `results --screen latest` were the previous screen's, under this one's name
  local sid
  sid=$(grep -m1 -oE "screen [0-9]+ attempt" "$out/$name.log" | cut -d' ' -f2)
  if [ -z "$sid" ]; then
    grep -E "rror" "$out/$name.log" | head -3; echo "   no screen started: nothing to audit"; return
  fi
  python3 -m packbench audit screen "$sid" >> "$out/$name.log" 2>&1; echo "   audit rc $?"
  grep -E "^(faithfulness|resources) |audit of|rror" "$out/$name.log" | sort -u | head -20
  grep -E "^problem: " "$out/$name.log" | head -5 | cut -c1-400 | sed "s/^/   /"  # the log may not come back (8 files a call)
  python3 -m packbench results --screen "$sid" --json > "$out/$name.json" 2>/dev/null
}
[ -n "${SKIP_B1:-}" ] || screen peers-b1 1 "${PROMPTS:-2}" "${PREFIX:-512}" "${ALLOWANCE:-4800}"
# Batched screens decode BATCH_CONT (8) tokens: 5 conditions x 2 episodes x 32 sequences' logits then
# stay within the audit's 640 MiB bound (16 tokens would be 982 MiB: tests/cli/test_archive_estimate.py).
# flexgen is left out of them by default: its teacher-forced logits are a seventh episode's worth, and
# the batch-32 screen's archive would be 687 MiB, over the audit's 640 (core/estimate.py archive_bytes;
# BATCH_CONDITIONS="... flexgen" with BATCH_CONT=7 fits, 601 MiB). FlexGen's batch sweep is its probe's below.
for b in ${BATCHES-32}; do
  conditions=${BATCH_CONDITIONS:-${CONDITIONS:-dense-stream packet phase-switched accelerate zero-inference}} \
    CONT=${BATCH_CONT:-8} screen "peers-b$b" "$b" "$b" "${BATCH_PREFIX:-64}" "${BATCH_ALLOWANCE:-5700}"
  # THEN_CONDITIONS: a second screen at the same batch after the first, on the checkpoint already
  # drawn (e.g. "dense-stream flexgen": a peer whose conversion or batch is slow then costs no other row)
  [ -z "${THEN_CONDITIONS:-}" ] || conditions=$THEN_CONDITIONS CONT=${BATCH_CONT:-8} \
    screen "peers-b$b-then" "$b" "$b" "${BATCH_PREFIX:-64}" "${BATCH_ALLOWANCE:-5700}"
done
# zero-inference's CUDA test (its own process: DeepSpeed binds its accelerator at first import): built
# under an allowance below the model's bytes, it decodes within it, logits dense-stream's.
zi_limit=$(within 150)  # within DEADLINE like the screens (its 150 s after screens that used theirs overran the call)
if [ -z "${TINY:-}" ] && [ -z "${SKIP_ZI_TEST:-}" ] && [ "$zi_limit" -le 30 ]; then
  echo "== zero-inference CUDA test: skipped, $zi_limit s left of DEADLINE less RESERVE"
elif [ -z "${TINY:-}" ] && [ -z "${SKIP_ZI_TEST:-}" ]; then
  timeout "$zi_limit" python3 -m pytest -q -m "deepspeed and gpu" -p no:cacheprovider tests/engine/test_zero_inference_cuda.py \
    > "$out/zi-cuda-test.log" 2>&1
  echo "== zero-inference CUDA test: rc $?"; grep -E "passed|failed|Error|assert" "$out/zi-cuda-test.log" | tail -6
fi
# FlexGen last: it reads the layout the flexgen condition converted into the model cache (or converts it
# there), its offload folder in $work (a 13B checkpoint and one converted copy fill 52 of the 64 GB disk).
ck=$(ls -d "$PACKBENCH_MODEL_CACHE"/*/ 2>/dev/null | grep -v '/flexgen/$' | head -1)  # flexgen/: the condition's converted layouts
left=$(( ${DEADLINE:-560} - ($(date +%s) - start) - 25 ))
if [ -z "${SKIP_FLEXGEN:-}" ] && [ "$left" -gt 40 ] && [ -n "$ck" ]; then
  echo "== flexgen probe ($left s)"
  timeout "$left" python3 -m bench.flexgen_probe "$ck" --shape "$SHAPE" --allowance-mib "${ALLOWANCE:-4800}" \
    --batches "${PROBE_BATCHES:-1,${FLEXGEN_BATCHES:-8,32}}" --prompt "${PREFIX:-512}" --gen "$CONT" \
    --cache "$PACKBENCH_MODEL_CACHE" --work "$work/flexgen-probe" 2> "$out/flexgen.err" > "$out/flexgen.json"
  echo "   probe rc $?"; tail -c 3000 "$out/flexgen.json"; grep -v Warning "$out/flexgen.err" | tail -5
else echo "== flexgen probe: skipped (SKIP_FLEXGEN=${SKIP_FLEXGEN:-}, $left s left, checkpoint '${ck}')"; fi
python3 - <<'PY' | tee "$out/table.txt"  # the table: one rule for every condition (module comment)
import statistics
from packbench.core.report import read_screen, serving_rows
from packbench.core.archive import ArchiveTooLarge
from packbench.db.store import Store

s = Store()
med = lambda xs: statistics.median(xs) if xs else float("nan")
print(f"{'screen':10} {'condition':15} {'batch':>5} {'ok':>3} {'TTFT ms':>8} {'steady ms/tok/seq':>17} "
      f"{'MB/call':>8} {'MB/tok':>7} {'peak alloc MiB':>14} {'peak sampled MiB':>16} {'tier':11} faithful")
for screen in sorted(s.list_screens(), key=lambda x: x.id):
    a = s.latest_attempt(screen.id)
    if a is None:
        continue
    try:
        data = read_screen(a.archive_path)
    except Exception as e:  # a screen cut short has no readable archive: say so, go on
        why = e.line(str(screen.id)) if isinstance(e, ArchiveTooLarge) else f"{type(e).__name__}: {e}"
        print(f"{screen.id}: {a.status}, archive not readable ({why})")
        continue
    batch = data.protocol.body.get("batch", 1)
    verdicts = {}
    for v in data.verdicts:
        key = (v.get("condition"), v.get("gate"))
        verdicts[key] = verdicts.get(key, True) and bool(v.get("passed"))
    eps = s.episodes(a.id)
    for e in eps:
        if e.status != "ok":
            print(f"  {data.protocol.body['name']}: episode {e.plan_index} {e.condition} failed: {(e.error or '')[:300]}")
    offload = next((e.record.get("offload") for e in data.episodes
                    if e.record.get("condition") == "zero-inference" and e.record.get("offload")), None)
    if offload:  # the configuration zero-inference ran with, and the allowance's arithmetic behind it
        zo, b = offload["ds_config"]["zero_optimization"], offload.get("budget") or {}
        print(f"  {data.protocol.body['name']}: zero-inference max_live/prefetch {zo['stage3_max_live_parameters']}"
              f"/{zo['stage3_prefetch_bucket_size']} elements, reuse {zo.get('stage3_max_reuse_distance', 'default')}, "
              f"gather budget {b.get('gather_bytes', 0) / 2**20:.0f} MiB, needs {b.get('needed_bytes', 0) / 2**20:.0f} MiB, "
              f"context {b.get('context', 0) / 2**20:.0f} MiB, KV {b.get('kv', 0) / 2**20:.0f} MiB, "
              f"activations {b.get('activations', 0) / 2**20:.0f} MiB, device after partitioning "
              f"{offload.get('device_bytes', 0) / 2**20:.0f} MiB")
    fg = next((e.record.get("offload") for e in data.episodes
               if e.record.get("condition") == "flexgen" and e.record.get("offload")), None)
    if fg:  # the placement FlexGen ran with (chosen on the worker from the allowance, or frozen)
        p = fg["policy"]
        print(f"  {data.protocol.body['name']}: flexgen {p['w_gpu_percent']}% of weights on the GPU "
              f"({'chosen' if p['chosen'] else 'frozen'}), cache {p['cache_gpu_percent']}%, activations "
              f"{p['act_gpu_percent']}%, GPU batch {p['gpu_batch_size']}: weights {p['weights_gpu'] / 2**20:.0f} MiB, "
              f"KV {p['cache_gpu'] / 2**20:.0f} MiB, working {p['working'] / 2**20:.0f} MiB, context "
              f"{p['context'] / 2**20:.0f} MiB, needs {p['needed_bytes'] / 2**20:.0f} of {p['allowance'] / 2**20:.0f} MiB; "
              f"pinned host {fg['pinned_bytes'] / 2**20:.0f} MiB, device after placement "
              f"{fg['device_bytes'] / 2**20:.0f} MiB, convert {fg['convert_s']:.1f} s, load {fg['load_s']:.1f} s")
    for r in serving_rows(data):
        c = r["condition"]
        ok = [x for x in eps if x.condition == c and x.role == "scored" and x.status == "ok"]
        calls = max(1, (data.protocol.body["continuation_tokens"] - 1))
        per_call = med([(x.decode_h2d_bytes or 0) / calls / 1e6 for x in ok])
        steady = r["steady_call_s"]
        faithful = verdicts.get((c, "faithfulness"), "-")
        if (c, "fidelity") in verdicts:  # an approximate condition (flexgen): its fidelity gate's verdict
            faithful = f"fidelity {'PASS' if verdicts[(c, 'fidelity')] else 'FAIL'}"
        print(f"{data.protocol.body['name']:10} {c:15} {batch:>5} {len(ok):>3} "
              f"{(r['ttft_s'] or float('nan')) * 1e3:>8.1f} {(steady / batch * 1e3 if steady else float('nan')):>17.3f} "
              f"{per_call:>8.1f} {per_call / batch:>7.1f} "
              f"{max([(x.peak_allocated_bytes or 0) for x in ok], default=0) / 2**20:>14.0f} "
              f"{max([(x.peak_sampled_bytes or 0) for x in ok], default=0) / 2**20:>16.0f} {r['tier']:11} {faithful}")
PY
echo "done in $(( $(date +%s) - start )) s"
