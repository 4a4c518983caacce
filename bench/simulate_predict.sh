#!/usr/bin/env bash
# Predictions before the runs (CPU, no GPU): the decode ms/token of bench/moe_device.sh's MoE
# conditions (ONLY=packets) and of bench/moe_cache_device.sh's expert caches and forecasts
# (ONLY=cache: synthesizes and traces the real shapes with fewer layers, ~10 GB of host memory and
# minutes), from `packbench simulate` on traces of the same shapes and the machine's measured
# rates (bench/machines/$MACHINE.json). Appends dated sections to docs/experiments/simulate.md;
# run it before the device scripts and commit the file.
#   bash bench/simulate_predict.sh            # MACHINE=h200 PREFIX=128 CONT=16 ONLY=all (the device scripts')
#   ONLY=cache bash bench/simulate_predict.sh --work /tmp/cache-traces --mixtral-layers 2
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -m bench.simulate_predict --machine "${MACHINE:-h200}" \
  --prefix "${PREFIX:-128}" --continuation "${CONT:-16}" --only "${ONLY:-all}" "$@"
