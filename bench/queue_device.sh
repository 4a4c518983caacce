#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (issues 12 and 13): the job queue on real GPUs.
#   A. two screens of synthetic opt-1.3b fp16 (every exact policy, 3 x 512 + 16 tokens): one after
#      the other (one worker) against concurrently (one worker per GPU); audits fanned out;
#      a second packbench on a GPU already held is refused.
#   B. two Ray nodes on one host (one GPU each; `ray start` twice on 127.0.0.1, or TWO_NODES_PY=1 for
#      bench/two_nodes.py): --replicas 2 --spread, audits on the other node.
#   C. a worker killed mid-screen: the screen is requeued and completes on the other node.
# Run from the project root with .whl carried: bash bench/queue_device.sh
# SKIP_A34=1 skips A3-A4, ONLY_BC=1 runs B and C alone, ONLY_A=1 runs A1-A2 alone (after a startup
# probe, a cache-warming pair, the pair on a standing `dispatch --follow`, then each screen by a
# dispatch of its own one after the other, and with VARIANT_ENV="K=V ..."
# one more pair under that environment, e.g. VARIANT_ENV=PACKBENCH_WORKER_PIN=1 for workers pinned to
# their share of the cores); MODE=graph runs the screens in engine mode graph.
# A CPU dry run of the plumbing: SKIP_WHEELS=1 SHAPE=tiny DTYPE=float32 PREFIX=8 CONT=4 PACKBENCH_EMBEDDED_GPUS=2 bash bench/queue_device.sh
set -uo pipefail
[ -n "${SKIP_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=$PATH RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null || echo 'no GPU (dry run)'
# The host's topology: two workers share its cores and memory (hyperthread siblings, NUMA nodes,
# which CPUs each GPU is near).
lscpu | grep -E '^(CPU\(s\)|Thread|Core|Socket|NUMA)' ; nvidia-smi topo -m 2>/dev/null | head -6
now() { python3 -c "import time; print(time.time())"; }
since() { python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 2))" "$1"; }
source "$PWD/bench/every_policy.sh"
source "$PWD/bench/device_common.sh"; work_dir; cd "$work"
export PACKBENCH_DB_URL="sqlite:///$work/pb.db" PACKBENCH_ARCHIVE_DIR="$work/archives"
t=$(now); every_policy_screen queue-opt-1.3b
echo "synth ${SHAPE:-opt-1.3b}: $(since $t) s"
pb db upgrade >/dev/null
attempts() {  # screen attempts: where and how
python3 - "$@" <<'PY'
import sys
from packbench.db.store import Store
s = Store()
for sid in map(int, sys.argv[1:]):
    for a in s.attempts(sid):
        dur = (a.finished_at - a.started_at).total_seconds() if a.finished_at else None
        v = s.verdicts(a.id)
        faith = all(x.passed for x in v if x.gate == "faithfulness")
        print(f"screen {sid} attempt {a.number}: {a.status:9} node {a.node[:12]} gpu {a.gpu_name} #{a.gpu_index} "
              f"{a.model_state} shared={a.shared_node} {dur and round(dur, 1)} s, faithfulness all pass: {faith}, "
              f"episodes {len(s.episodes(a.id))} {('error: ' + a.error[:90]) if a.error else ''}")
PY
}
if [ -z "${ONLY_BC:-}" ]; then
concurrent() {  # the two screens' protocol queued twice, drained by one worker per GPU
ids=$(pb submit p.yaml --replicas 2 | grep -o '[0-9, ]*;' | tr -d ',;')
t=$(now); pb dispatch > a2.log 2>&1; echo "rc $?"; par=$(since $t)
attempts $ids; python3 -m bench.queue_timeline $t $ids; par_ids=$ids
}
sequential() {  # the same, one worker: one screen after the other
ids=$(pb submit p.yaml --replicas 2 | grep -o '[0-9, ]*;' | tr -d ',;')
t=$(now); pb dispatch --workers 1 > a1.log 2>&1; echo "rc $?"; seq=$(since $t)
attempts $ids; python3 -m bench.queue_timeline $t $ids; first_ids=$ids
}
separate() {  # the literal "one after the other": each screen queued alone and drained by its own
# `packbench dispatch --workers 1` (each pays its own start and a cold load)
local t; t=$(now); sep_ids=""
for _ in 1 2; do
  local id; id=$(pb submit p.yaml | grep -o 'screen [0-9]*' | grep -o '[0-9]*'); sep_ids="$sep_ids $id"
  pb dispatch --workers 1 > sep.log 2>&1 || true
done
sep=$(since $t); attempts $sep_ids
}
standing() {  # $1: workers. A dispatcher already serving (--follow, its workers ready): the wall
# from submitting the two screens to both done, without the dispatcher's own start and exit.
python3 -m packbench dispatch --follow --workers "$1" > standing.log 2>&1 & local holder=$!
for _ in $(seq 600); do [ "$(grep -c ' ready on ' standing.log)" -ge "$1" ] && break; sleep 0.2; done
local t; t=$(now)
ids=$(pb submit p.yaml --replicas 2 | grep -o '[0-9, ]*;' | tr -d ',;')
python3 - $ids <<'PY'
import sys, time
from packbench.db.store import Store
s = Store()
while any(s.screen(int(i)).status not in ("done", "failed", "cancelled") for i in sys.argv[1:]):
    time.sleep(0.1)
PY
standing_wall=$(since $t)
kill -TERM $holder; wait $holder 2>/dev/null
attempts $ids; python3 -m bench.queue_timeline $t $ids | sed -n '1,3p'
}
if [ -n "${ONLY_A:-}" ]; then
  echo "== startup probe"; python3 -m bench.startup_probe --rounds 1 2>&1 | tail -3
  # Host caches (Triton's kernel cache, the page cache) are cold for whatever runs first: a
  # concurrent pair warms them.
  echo "== A0: concurrently, host caches cold"; concurrent
  echo "== S1/S2: a standing dispatcher (--follow), one worker, then one per GPU"
  standing 1; s_seq=$standing_wall; standing 2; s_par=$standing_wall
  echo "standing dispatcher, submit to both done: one worker $s_seq s, one per GPU $s_par s, ratio $(python3 -c "print(round($s_par / $s_seq, 3))")"
  if [ -n "${VARIANT_ENV:-}" ]; then  # e.g. "OMP_WAIT_POLICY=PASSIVE PACKBENCH_WORKER_PIN=1": the workers inherit them
    echo "== A1/A2 with $VARIANT_ENV"
    for kv in $VARIANT_ENV; do export "$kv"; done
    sequential; concurrent
    for kv in $VARIANT_ENV; do unset "${kv%%=*}"; done
    echo "$VARIANT_ENV: sequential $seq s, concurrent $par s, ratio $(python3 -c "print(round($par / $seq, 3))")"
  fi
fi
echo "== A1: two screens one after the other (one worker)"; sequential
echo "== A2: the same two screens' protocol, concurrently (one worker per GPU)"; concurrent; ids=$par_ids
echo "wall: sequential $seq s, concurrent $par s, ratio $(python3 -c "print(round($par / $seq, 3))")"
if [ -n "${ONLY_A:-}" ]; then
  echo "== A3': the same two screens, each drained by a dispatch of its own, one after the other"; separate
  echo "wall: two dispatches one after the other $sep s, concurrent $par s, ratio $(python3 -c "print(round($par / $sep, 3))")"
fi
python3 - $first_ids $ids <<'PY'
import sys
from packbench.db.store import Store
s = Store()
ids = list(map(int, sys.argv[1:]))
def span(pair):  # the screens' own wall: first attempt start to last attempt end (no dispatcher start-up)
    attempts = [s.latest_attempt(i) for i in pair]
    return (max(a.finished_at for a in attempts) - min(a.started_at for a in attempts)).total_seconds()
seq, par = span(ids[:2]), span(ids[2:])
print(f"screens' span: sequential {seq:.1f} s, concurrent {par:.1f} s, ratio {par / seq:.3f}")
PY
if [ -n "${ONLY_A:-}" ]; then echo "== audits of the concurrent pair"; pb audit $ids 2>&1 | grep -E "^audit of"; exit 0; fi
fi
if [ -z "${SKIP_A34:-}${ONLY_BC:-}" ]; then
echo "== A3: audits fanned out"
pb audit --all --ray 2>&1 | tail -6
echo "== A4: a second packbench on a GPU already held"
python3 -m packbench dispatch --follow --workers 2 > a4.log 2>&1 & holder=$!
sleep 25
t=$(now); pb submit p.yaml --wait > a4b.log 2>&1; echo "second packbench: rc $? after $(since $t) s"; tail -2 a4b.log
kill -TERM $holder; wait $holder; echo "holder dispatcher rc $?"; tail -1 a4.log
pb screens cancel latest | tail -1
fi
echo "== B: two Ray nodes on one host"
ray_cli() { python3 -m ray.scripts.scripts "$@"; }  # the wheel's `ray` script is not on PATH here
nodes=""
if [ -z "${TWO_NODES_PY:-}" ]; then
  # The issue's commands: `ray start --head` with GPU 0, `ray start --address` with GPU 1. On the
  # loopback address: at the host's own address (192.0.2.2 here) the second node never reached
  # the head's GCS.
  CUDA_VISIBLE_DEVICES=0 ray_cli start --head --node-ip-address 127.0.0.1 --port 6390 --num-gpus 1 \
    --include-dashboard false --disable-usage-stats > ray_head.log 2>&1 || { echo "ray start --head failed"; tail -3 ray_head.log; }
  CUDA_VISIBLE_DEVICES=1 ray_cli start --address 127.0.0.1:6390 --node-ip-address 127.0.0.1 --num-gpus 1 \
    --disable-usage-stats > ray_node.log 2>&1 || { echo "ray start --address failed"; tail -3 ray_node.log; }
  head=127.0.0.1:6390
else
  # A CPU head and one node per GPU, each raylet with its own CUDA_VISIBLE_DEVICES (ray.cluster_utils).
  python3 -m bench.two_nodes "$work/address" --gpus 2 > two_nodes.log 2>&1 & nodes=$!
  for _ in $(seq 120); do [ -s "$work/address" ] && break; sleep 0.5; done
  head=$(cat "$work/address" 2>/dev/null) || { echo "no two-node cluster"; cat two_nodes.log; exit 1; }
fi
timeout 40 python3 -c "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); print('nodes', len([n for n in ray.nodes() if n['Alive']]), 'GPUs', ray.cluster_resources().get('GPU'))" "$head" || { echo "no two-node cluster"; exit 1; }
ids=$(pb submit p.yaml --replicas 2 --spread | grep -o '[0-9, ]*;' | tr -d ',;')
timeout 150 python3 -m packbench dispatch --address $head > b.log 2>&1; echo "rc $?"
attempts $ids
pb audit $ids --ray --address $head --other-node 2>&1 | tail -3
python3 - $ids <<'PY'
import sys
from packbench.db.store import Store
s = Store()
for sid in map(int, sys.argv[1:]):
    a = s.latest_attempt(sid)
    print(f"screen {sid}: produced on {a.node[:12]}, audited on", [u.node[:12] for u in s.audits(a.id)])
a, b = (s.latest_attempt(int(i)) for i in sys.argv[1:3])
va = {(v.gate, v.condition, v.phase): v.passed for v in s.verdicts(a.id)}
vb = {(v.gate, v.condition, v.phase): v.passed for v in s.verdicts(b.id)}
print("verdicts agree across the two nodes:", va == vb, f"({len(va)} verdicts)")
PY
echo "== C: a worker killed mid-screen"
id=$(pb submit p.yaml | grep -o 'screen [0-9]*' | grep -o '[0-9]*')
python3 -m packbench dispatch --address $head > c.log 2>&1 & disp=$!
python3 - $id <<'PY'
import os, signal, sys, time
from packbench.db.store import Store
s = Store(); sid = int(sys.argv[1])
for _ in range(600):
    live = [a for a in s.attempts(sid) if a.status == "running"]
    if live and len(s.episodes(live[0].id)) >= 3:
        pid = int(live[0].worker.rsplit("pid ", 1)[1]); os.kill(pid, signal.SIGKILL)
        print(f"killed {live[0].worker} on node {live[0].node[:12]} after {len(s.episodes(live[0].id))} episodes"); break
    time.sleep(0.2)
PY
( sleep 150; kill -TERM $disp 2>/dev/null ) & wait $disp; echo "dispatch rc $?"
attempts $id
if [ -n "$nodes" ]; then kill -TERM $nodes; wait $nodes 2>/dev/null; else ray_cli stop --force > /dev/null 2>&1; fi
