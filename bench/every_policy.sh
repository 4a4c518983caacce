# Sourced by bench/queue_device.sh and bench/reexecute_device.sh: the device runs' screen of
# every exact policy (issues 10 and 13). SHAPE, DTYPE, PREFIX and CONT shrink it for CPU dry runs.
# Usage: every_policy_screen NAME  -> synthesises ./m13 (once) and writes ./p.yaml
every_policy_screen() {
  [ -f m13/config.json ] || python3 -m packbench model synth --shape ${SHAPE:-opt-1.3b} --dtype ${DTYPE:-float16} \
    --sparsity 0.94 --seed 0 --hot-fraction 0.05 --out m13 >/dev/null
  cat > p.yaml <<YAML
schema: 2
name: $1
model: {path: m13}
dtype: ${DTYPE:-float16}
prompts: {generator: {seed: 0, count: 3}}
prefix_tokens: ${PREFIX:-512}
continuation_tokens: ${CONT:-16}
conditions:
  - {policy: dense-stream}
  - {policy: resident}
  - {policy: sparse-extents}
  - {policy: packet}
  - {name: packet-device, policy: packet, params: {gather: device}}
  - {policy: phase-switched}
  - {policy: row-retention, params: {rows_per_layer: 1024}}
  - {policy: early-forecast}
reference: dense-stream
warmups: 1
allowance_mib: 4800
gates:
  faithfulness: {tolerance: 0.0}
  acquisition: {control: dense-stream, max_ratio: 0.5}
YAML
  [ "${MODE:-eager}" = eager ] || echo "engine: {mode: ${MODE}}" >> p.yaml
}
