#!/usr/bin/env bash
# One device call: CUDA twins of the engine tests, a whole screen through Ray on the GPU with
# audit, then the policy benchmark. Run from the project root on the GPU machine, with .whl carried.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled
source "$(dirname "$0")/device_common.sh"; device_header

echo "== CUDA tests"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -5

echo "== screen through Ray on the GPU"
work_dir
python3 -m packbench model synth --shape opt-125m --dtype float16 --out "$work/m125"
cat > "$work/p.yaml" <<YAML
name: gpu-check
model: {path: m125}
dtype: float16
prompts: {generator: {seed: 0, count: 2}}
prefix_tokens: 64
continuation_tokens: 8
conditions:
  - {policy: dense-stream}
  - {policy: resident}
  - {policy: sparse-extents}
  - {policy: packet, params: {gather: host}}
  - {name: packet-device, policy: packet, params: {gather: device}}
  - {policy: phase-switched}
  - {policy: row-retention, params: {rows_per_layer: 256}}
  - {policy: early-forecast}
reference: dense-stream
warmups: 1
allowance_mib: 4800
gates:
  faithfulness: {tolerance: 0.0}
  resources: {}
  acquisition: {control: dense-stream, max_ratio: 0.5}
  runtime: {control: dense-stream, max_ratio: 1.0}
YAML
export PACKBENCH_DB_URL="sqlite:///$work/pb.db"
python3 -m packbench db upgrade
python3 -m packbench submit "$work/p.yaml" --wait --archive-dir "$work/archives" 2>&1 | grep -v "^  episode" | tail -32
python3 -m packbench audit latest 2>&1 | tail -2

echo "== benchmark"
python3 -m bench.engine "$@"

echo "== mapped gather"
python3 -m bench.mapped_gather
