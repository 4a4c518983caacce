# Sourced by the device scripts (after setting $out, where full logs go).

device_header() {  # what machine and software a run's numbers come from
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
  date -u
}

engine_cuda_tests() {  # every engine CUDA test, the log in $out/pytest.log
  echo "== CUDA tests (engine)"
  timeout 200 python3 -m pytest -q -m "gpu and not deepspeed" -p no:cacheprovider tests/engine > "$out/pytest.log" 2>&1; echo "pytest rc $?"
  grep -E "passed|failed|Error" "$out/pytest.log" | tail -6
}

install_wheels() {  # the carried .whl into /tmp/site (once per machine), on the path; SKIP_WHEELS: none
  [ -n "${SKIP_WHEELS:-}" ] || [ -d /tmp/site/ray ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
}

work_dir() {  # $work: a fresh folder, removed when the script ends (also at `timeout`'s TERM); a warm
  # machine keeps /tmp between calls, and three OPT-13B calls' checkpoints left there filled its disk
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
}

product_env() {  # the wheels on the path, and a fresh database, archive and model cache in $work; pb runs the CLI
  install_wheels
  export RAY_AUTH_MODE=disabled
  work_dir
  export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives" PACKBENCH_MODEL_CACHE="$work/models"
  python3 -m packbench db upgrade > /dev/null
}
pb() { python3 -m packbench "$@"; }
verdict() {  # LOG: its audit's verdict line (rc 0 is also a PARTIAL audit of a screen cut short: say which)
  # and its first problem lines: a call brings back at most 8 files, so the log may not come back
  grep -E "^(error: )?audit of" "$1" | tail -1 | sed "s/^/   /"
  grep -E "^problem: " "$1" | head -5 | cut -c1-400 | sed "s/^/   /"
}

# ----------------------------------------------------------------------------- the MoE scripts' preamble

moe_tiny() {  # TINY=1: the CPU-sized run on the tiny MoE shapes (no wheels, no GPU), this checkout's
  # packbench and a python with torch (PYTHON, else the shared venv's, else python3); a script sets
  # its own tiny values first, these fill the rest
  [ -n "${TINY:-}" ] || return 0
  export SKIP_WHEELS=1 PYTHONPATH=$PWD
  DEVICE=cpu
  : "${QWEN_SHAPE:=qwen3-moe-tiny}" "${QWEN_LAYERS:=3}" "${MIXTRAL_SHAPE:=mixtral-tiny}" "${MIXTRAL_LAYERS:=3}"
  : "${PREFIX:=16}" "${CONT:=4}" "${ALLOWANCE_MIB:=64}"
  py=${PYTHON:-/work/main/.venv/bin/python}; [ -x "$py" ] || py=python3
  python3() { command "$py" "$@"; }
}

moe_begin() {  # after $out is set: TINY's values, the product's environment, the machine; DEV P C ALLOW
  moe_tiny
  product_env
  if command -v nvidia-smi >/dev/null; then device_header; fi
  DEV=${DEVICE:-cuda}; P=${PREFIX:-128}; C=${CONT:-16}; ALLOW=${ALLOWANCE_MIB:-24576}
}

moe_specs() {  # one "shape layers" line per shape SHAPES names (default "qwen mixtral")
  if [[ "${SHAPES:-qwen mixtral}" == *qwen* ]]; then echo "${QWEN_SHAPE:-qwen3-30b-a3b} ${QWEN_LAYERS:-12}"; fi
  if [[ "${SHAPES:-qwen mixtral}" == *mixtral* ]]; then echo "${MIXTRAL_SHAPE:-mixtral-8x7b} ${MIXTRAL_LAYERS:-4}"; fi
}

moe_synth() {  # SHAPE LAYERS DIR [DTYPE]: the synthetic checkpoint drawn on $DEV (log $out/SHAPE-synth.log), one line
  local t0 rc
  t0=$(date +%s)
  pb model synth --out "$3" --shape "$1" --dtype "${4:-float16}" --layers "$2" --device "$DEV" > "$out/$1-synth.log" 2>&1
  rc=$?
  echo "== $1, $2 layers: synth rc $rc in $(( $(date +%s) - t0 )) s ($(du -sh "$3" | cut -f1))"
}

moe_cache_caps() {  # SHAPE: "lo mid hi", the three expert-cache capacities of that shape
  if [ "$1" = "${QWEN_SHAPE:-qwen3-30b-a3b}" ]; then echo "${QWEN_CAPS:-16 32 64}"; else echo "${MIXTRAL_CAPS:-2 4 6}"; fi
}

moe_protocol_head() {  # NAME DIR SEED: a MoE screen's first lines (checkpoint DIR in $DT, one generated prompt, $P + $C tokens)
  cat <<YAML
name: $1
model: {path: $2}
dtype: $DT
prompts: {generator: {seed: $3, count: 1}}
prefix_tokens: $P
continuation_tokens: $C
YAML
}

moe_cache_conditions() {  # LO MID HI: the caches' and forecasts' protocol entries (after dense-stream and packet)
  cat <<YAML
  - {name: lru-$1, policy: expert-cache, params: {capacity: $1}}
  - {name: lru-$2, policy: expert-cache, params: {capacity: $2}}
  - {name: lru-$3, policy: expert-cache, params: {capacity: $3}}
  - {name: lfu-$2, policy: expert-cache, params: {capacity: $2, rule: lfu}}
  - {policy: expert-forecast}
  - {name: lru-$2-forecast, policy: expert-cache, params: {capacity: $2, forecast: "on"}}
YAML
}

log_filter() {  # a run's log without the libraries' warnings and progress bars
  grep -vE "^W[0-9]|Warn|warn|Loading|Writing|output = func|torchao"
}

moe_end() {  # the screens' archives beside the logs
  cp -r "$work/archives" "$out/" 2>/dev/null
}
