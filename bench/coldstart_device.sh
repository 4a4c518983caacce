#!/usr/bin/env bash
# One device call (about 5-7 min on nvidia-h200): where a fresh process spends the placed read of
# OPT-2.7B fp16, and read_placed's host layouts against the old read (bench/legacy_read.py), in
# fresh processes, alternated. Run from the project root with .whl carried:
#   bash bench/coldstart_device.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
source "$(dirname "$0")/device_common.sh"; device_header
nproc; free -g | head -2; uname -r; cat /sys/kernel/mm/transparent_hugepage/enabled

echo "== CUDA tests of the read (bytes, pinned, logits per host layout)"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_checkpoint_cuda.py 2>&1 | tail -4

echo "== the checkpoint (bench.engine's synthetic OPT-2.7B fp16, 5.30 GB, in /tmp)"
timeout 200 python3 -c "
import tempfile; from pathlib import Path; from packbench.engine.synth import synth_checkpoint
d = Path(tempfile.gettempdir()) / 'packbench-opt-2.7b-float16-0.94-hot0.05-0.0'
(d / 'config.json').exists() or synth_checkpoint(d, shape='opt-2.7b', dtype='float16', sparsity=0.94, seed=0, hot_fraction=0.05, hot_bias=0.0)
print(d, sum(f.stat().st_size for f in d.glob('*.safetensors')) / 1e9, 'GB')" || exit 1

echo "== fresh-process probes (imports excluded, CUDA context apart)"
timeout 240 python3 -m bench.coldstart --shape opt-2.7b --dtype float16 --profile --fresh --repeats 2

echo "== fresh processes, worker entry to the first logit (mode graph)"
timeout 200 python3 -m bench.coldstart --shape opt-2.7b --dtype float16 --repeats 2 \
  --variants "placed-graph@legacy,placed-graph@blocks,placed-graph@register,placed-graph@map"
