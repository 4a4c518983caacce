#!/usr/bin/env bash
# Predictions before the runs (CPU, no GPU, no weights of the real shapes): the decode ms/token of
# bench/moe_device.sh's MoE conditions on a machine, from `packbench simulate` on traces of the
# same shapes and the machine's measured rates (bench/machines/$MACHINE.json). Appends a dated
# section to docs/experiments/simulate.md; run it before bench/moe_device.sh and commit the file.
#   bash bench/simulate_predict.sh            # MACHINE=h200 PREFIX=128 CONT=16 (bench/moe_device.sh's)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -m bench.simulate_predict --machine "${MACHINE:-h200}" \
  --prefix "${PREFIX:-128}" --continuation "${CONT:-16}" "$@"
