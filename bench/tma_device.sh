#!/usr/bin/env bash
# One device call (issue 26, target 2): do bulk tensor copies (TMA) read mapped host rows faster
# than the shipped gather's per-thread loads?
#  1. bench.gather_floor at SHAPES (opt-2.7b): the TMA variants beside the copy engine and the
#     shipped gather (each gather checked bit for bit);
#  2. unless SKIP_ENGINE: bench.engine, alternated: packet {gather: device} beside resident
#     (calibrated OPT-2.7B fp16, 3 x 512 + 16, 4800 MiB, graph). At commit 38a8467 it also ran the
#     engine's TMA gather (+kernel=tma), measured slower and reverted.
#     bash bench/tma_device.sh
set -uo pipefail
root=$PWD; out=${OUT:-$root/tma-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for shape in $(echo "${SHAPES:-opt-2.7b}" | tr , ' '); do
  echo "== gather floor $shape"
  timeout 200 python3 -m bench.gather_floor --shape "$shape" > "$out/floor-$shape.log" 2>&1; rc=$?
  echo "gather_floor rc $rc"; grep -v Warning "$out/floor-$shape.log" | tail -24
  if [ $rc -ne 0 ]; then
    timeout 150 python3 -m bench.gather_floor --shape "$shape" --no-tma > "$out/floor-$shape-notma.log" 2>&1
    echo "gather_floor --no-tma rc $?"; tail -20 "$out/floor-$shape-notma.log"
  fi
done
if [ -z "${SKIP_ENGINE:-}" ]; then
  echo "== bench.engine"
  c="packet+gather=device+mode=graph,resident+unbounded=yes+mode=graph"
  timeout 240 python3 -m bench.engine --shape opt-2.7b --dtype float16 --profile opt --prefix 512 --continuation 16 \
    --rounds "${ROUNDS:-3}" --allowance-mib 4800 --conditions "$c" > "$out/engine.log" 2>&1
  echo "bench.engine rc $?"; grep -v -e Warning -e "Failed to load" "$out/engine.log" | tail -30
fi
