"""The job queue's own costs, measured on this machine (docs/experiments/queue.md).

    python -m bench.cluster                 # queue-path overheads + 1 vs 2 logical GPUs (CPU machine)
    python -m bench.cluster --simulate      # 8 logical GPU nodes, 4 dispatchers, 200 screens, PostgreSQL

Default mode, tiny synthetic model, embedded Ray, a fresh SQLite database per run:

- per-episode overhead of the queue path: (first episode handed to the worker -> last record
  persisted) minus the engine's own `wall_s` of every episode, per episode; and the driver's
  own time per record (archive append + database row);
- per-screen overhead on a warm worker: claim -> first episode handed to the worker, for
  screens after the first on a worker (same model: the worker keeps it);
- wall of N equal screens on 1 and on 2 logical GPUs, alternated (each in its own process).

`--simulate` starts a `ray.cluster_utils.Cluster` of 8 logical GPU nodes and runs 4
dispatcher threads (2 workers each) whose workers are `SimulatedWorker` (below: sleeps for a
drawn episode time, no engine). It exists only here: the product's CLI cannot reach it, and it
writes only to a throwaway PostgreSQL schema that is dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def protocol(folder: Path, *, prompts: int, continuation: int, name: str = "bench-queue") -> Path:
    body = {"schema": 2, "name": name,
            "model": {"synth": {"shape": "tiny", "dtype": "float32", "sparsity": 0.94, "seed": 0}},
            "dtype": "float32", "prompts": {"generator": {"seed": 0, "count": prompts}}, "prefix_tokens": 8,
            "continuation_tokens": continuation, "conditions": [{"policy": "dense-stream"}, {"policy": "packet"}],
            "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "gates": {"faithfulness": {}}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


class Timeline:
    """One attempt as the dispatcher's observer heard it (driver-side perf_counter clock)."""

    def __init__(self, run) -> None:
        self.run = run  # the attempt's ScreenRun: its episodes, start record and attempt row
        self.created = 0.0  # claimed (its ScreenRun made)
        self.claim_s = 0.0  # the claim_screen call itself
        self.loaded: float | None = None  # the load's result back at the driver
        self.first: float | None = None  # its first episodes handed to the worker
        self.timings: list[tuple[float, float]] = []  # per record: (arrival, seconds spent recording it)

    @property
    def episodes(self) -> list[dict]:
        return self.run.episodes


class Timelines:
    """A dispatcher's observer (one per dispatcher): every attempt's timeline, in claim order."""

    def __init__(self) -> None:
        self.by_run: dict[int, Timeline] = {}

    def __call__(self, event) -> None:
        from packbench.service.dispatcher.state import Moment

        t = self.by_run.setdefault(id(event.run), Timeline(event.run))
        if event.moment is Moment.CLAIMED:
            t.created, t.claim_s = event.at, event.seconds
        elif event.moment is Moment.LOADED:
            t.loaded = event.at
        elif event.moment is Moment.FIRST_OUT:
            t.first = event.at
        elif event.moment is Moment.RECORDED:
            t.timings.append((event.at, event.seconds))

    def runs(self) -> list[Timeline]:
        """Every attempt the dispatcher claimed, in claim order."""
        return list(self.by_run.values())


def screen_switches(runs: list[Timeline]) -> list[float]:
    """Per worker, between consecutive screens: the previous screen's last record back at the
    driver -> the next screen's first episode handed to the worker (its load included)."""
    by_worker: dict[str, list[Timeline]] = {}
    for r in runs:
        if r.loaded is not None and r.timings:
            by_worker.setdefault(r.run.attempt.worker, []).append(r)
    out = []
    for mine in by_worker.values():
        mine.sort(key=lambda r: r.loaded)
        out += [b.first - a.timings[-1][0] for a, b in zip(mine, mine[1:])]
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


# ----------------------------------------------------------------------------- one run (a child process)


def one_run(gpus: int, screens: int, prompts: int, continuation: int) -> dict:
    """Queue `screens` equal screens and drain them with a dispatcher on `gpus` logical GPUs."""
    from packbench.cluster.pool import RayPool
    from packbench.core.settings import Settings
    from packbench.db.store import Store
    from packbench.service.dispatcher import Dispatcher
    from packbench.service.submit import submit

    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        tmp = Path(tmp)
        store = Store(f"sqlite:///{tmp / 'packbench.db'}")
        store.upgrade()
        submit(store, protocol(tmp, prompts=prompts, continuation=continuation), replicas=screens)
        settings = Settings(archive_dir=tmp / "archives", model_cache=tmp / "models", embedded_gpus=gpus)
        timelines = Timelines()
        d = Dispatcher(store, settings, RayPool(settings), lease_s=60, observer=timelines)
        from packbench.cluster.runtime import ensure_ray

        ensure_ray(settings)
        t0 = time.perf_counter()
        outcomes = d.run()
        wall = time.perf_counter() - t0
        assert all(o.status == "done" for o in outcomes), outcomes
        runs = timelines.runs()
        per_episode, record_s, warm_claims, cold_claims = [], [], [], []
        for run in runs:
            walls = sum(e["wall_s"] for e in run.episodes)
            phase = run.timings[-1][0] + run.timings[-1][1] - run.loaded
            per_episode.append((phase - walls) / len(run.episodes))
            record_s += [t for _, t in run.timings]
            (warm_claims if run.run.start["model_state"] == "warm" else cold_claims).append(run.loaded - run.created)
        # The first screen's wall includes the workers' cold start; the scaling compares from
        # the first model ready to the last screen done.
        first_ready = min(r.loaded for r in runs)
        last_done = max(r.timings[-1][0] + r.timings[-1][1] for r in runs)
        return {"gpus": gpus, "screens": screens, "episodes": sum(len(r.episodes) for r in runs),
                "wall_s": wall, "drain_s": last_done - first_ready,
                "overhead_ms_per_episode": [1000 * x for x in per_episode],
                "record_ms": [1000 * x for x in record_s],
                "warm_claim_to_first_episode_s": warm_claims, "cold_claim_to_first_episode_s": cold_claims,
                "switch_s": screen_switches(runs),
                "nodes": len({r.run.attempt.node for r in runs})}


def default_mode(args) -> None:
    runs = []
    for i in range(args.rounds):
        for gpus in (1, 2):
            out = subprocess.run([sys.executable, "-m", "bench.cluster", "--child", str(gpus), "--screens",
                                  str(args.screens), "--prompts", str(args.prompts), "--continuation",
                                  str(args.continuation)], cwd=ROOT, capture_output=True, text=True,
                                 env=dict(os.environ, RAY_AUTH_MODE="disabled"))
            if out.returncode != 0:
                sys.exit(f"child run failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = runs[-1]
            print(f"round {i + 1} gpus {gpus}: wall {r['wall_s']:.2f} s, drain {r['drain_s']:.2f} s, "
                  f"{r['episodes']} episodes", file=sys.stderr)
    by = {g: [r for r in runs if r["gpus"] == g] for g in (1, 2)}
    overhead = [x for r in runs for x in r["overhead_ms_per_episode"]]
    record = [x for r in runs for x in r["record_ms"]]
    warm = [x for r in runs for x in r["warm_claim_to_first_episode_s"]]
    cold = [x for r in runs for x in r["cold_claim_to_first_episode_s"]]
    switch = [x for r in runs for x in r["switch_s"]]
    ratio = [b["drain_s"] / a["drain_s"] for a, b in zip(by[1], by[2])]
    print(f"\n{args.screens} screens x {runs[0]['episodes'] // args.screens} episodes (tiny, CPU), "
          f"{args.rounds} rounds alternated, each run its own process and embedded Ray\n")
    print("| metric | median | p10-p90 | target |")
    print("| --- | --- | --- | --- |")
    print(f"| queue-path overhead per episode, ms (over the engine's wall_s) | {statistics.median(overhead):.2f} | "
          f"{pct(overhead, .1):.2f}-{pct(overhead, .9):.2f} | <= 5 |")
    print(f"| driver time per record (archive append + database row), ms | {statistics.median(record):.2f} | "
          f"{pct(record, .1):.2f}-{pct(record, .9):.2f} | |")
    print(f"| claim -> model ready at the driver, warm worker, s (a look-ahead claim waits for the previous "
          f"screen's last episodes) | {statistics.median(warm):.3f} | {pct(warm, .1):.3f}-{pct(warm, .9):.3f} | <= 0.5 |")
    print(f"| screen switch on a worker, ms (last record back -> next screen's first episode handed out) | "
          f"{1000 * statistics.median(switch):.1f} | {1000 * pct(switch, .1):.1f}-{1000 * pct(switch, .9):.1f} | |")
    print(f"| claim -> first episode, cold worker (model read), s | {statistics.median(cold):.3f} | "
          f"{pct(cold, .1):.3f}-{pct(cold, .9):.3f} | |")
    print(f"| drain wall, 2 logical GPUs / 1 (model ready -> last screen done) | {statistics.median(ratio):.2f} | "
          f"{min(ratio):.2f}-{max(ratio):.2f} | <= 0.65 |")
    print(f"| drain wall 1 GPU / 2 GPUs, s | {statistics.median([r['drain_s'] for r in by[1]]):.2f} / "
          f"{statistics.median([r['drain_s'] for r in by[2]]):.2f} | | |")


# ----------------------------------------------------------------------------- simulation


class SimulatedWorker:
    """A GPU worker that sleeps instead of running the engine (bench only: never in cluster/).

    Records are real episode records in shape (status failed with a stated cause, so no gate
    can pass on them), each taking an episode time drawn from a lognormal around `mean_s`.
    """

    def __init__(self, mean_s: float = 0.2, seed: int = 0) -> None:
        import platform
        import random

        self.rng = random.Random(seed ^ os.getpid())
        self.mean_s = mean_s
        self.busy_s = 0.0
        self.env = {"host": platform.node(), "pid": os.getpid(), "python": "", "torch": "", "cuda": "",
                    "device": "simulated", "gpu": "simulated", "gpu_index": "0", "driver": "", "gpu_uuid": ""}

    def describe(self) -> dict:
        import ray

        return {**self.env, "node_id": ray.get_runtime_context().get_node_id()}

    def load(self, protocol, model_dir, *, model_cache=None, reuse=True) -> dict:
        return {"vocab": 512, "model_dir": "", "model_state": "warm", "read_s": 0.0, "pin_s": 0.0, "place_s": 0.0,
                "param_bytes": 0, "device_param_bytes": 0, "host_outgoing_bytes": 0, "cpu_first": True,
                "allowance_bytes": 0, "context_bytes": 0, "device": "simulated", "entry_to_loaded_s": 0.0}

    def run(self, entry: dict, prompt: list[int]) -> dict:
        import math

        t = self.rng.lognormvariate(math.log(self.mean_s), 0.25)
        time.sleep(t)
        self.busy_s += t
        return {"plan_index": entry["index"], "condition": entry["condition"], "role": entry["role"],
                "prompt": entry["prompt"], "policy": "simulated", "params": {}, "status": "failed",
                "error": f"simulated episode ({t:.3f} s of sleep, no engine)", "traceback": "", "episode_s": t,
                "logits": None, "trace": None, "sim_busy_s": t}


def simulate(args) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    from packbench.cluster.pool import RayPool
    from packbench.core.settings import Settings
    from packbench.db.store import Store
    from packbench.service.dispatcher import Dispatcher
    from packbench.service.submit import submit

    base = args.pg_url or os.environ.get("PACKBENCH_TEST_PG_URL")
    if not base:
        sys.exit("--simulate needs PostgreSQL: pass --pg-url or set PACKBENCH_TEST_PG_URL")
    schema = f"pb_sim_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, poolclass=NullPool)
    with admin.begin() as c:
        c.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0})
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=1, num_gpus=1)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        actor = ray.remote(max_restarts=0, max_task_retries=0)(SimulatedWorker)
        with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
            tmp = Path(tmp)
            with Store(url) as s:
                s.upgrade()
                ids = submit(s, protocol(tmp, prompts=args.prompts, continuation=4, name="simulated"),
                             replicas=args.screens)
            settings = Settings(address=cluster.address, archive_dir=tmp / "archives")
            dispatchers, threads, timelines = [], [], []

            def drain(d):
                d.run()

            for _ in range(args.dispatchers):
                heard = Timelines()
                d = Dispatcher(Store(url), settings, RayPool(settings, worker_class=actor),
                              workers=args.nodes // args.dispatchers, lease_s=30, observer=heard,
                              look_ahead=not args.no_look_ahead)
                dispatchers.append(d)
                timelines.append(heard)
                threads.append(threading.Thread(target=drain, args=(d,)))
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            runs = [r for heard in timelines for r in heard.runs()]
            with Store(url) as s:
                attempts = [a for i in ids for a in s.attempts(i)]
                stuck = s.queue_status().counts.get("running", 0) + s.queue_status().counts.get("queued", 0)
            busy = sum(e.get("sim_busy_s", 0.0) for r in runs for e in r.episodes)
            # Utilisation while screens remain: between the first episode handed out and the last
            # claim (the queue is dry after it), GPU-seconds asleep in episodes / GPU-seconds there
            # were. An episode's interval is [arrival at the driver - its sleep, arrival].
            first = min(r.loaded for r in runs)
            dry = max(r.created for r in runs)
            inside = 0.0
            for r in runs:
                for (arrival, _), e in zip(r.timings, r.episodes):
                    start, end = arrival - e.get("sim_busy_s", 0.0), arrival
                    inside += max(0.0, min(end, dry) - max(start, first))
            per_screen = statistics.median([r.timings[-1][0] - r.loaded for r in runs])
            switch = screen_switches(runs)
            claim_s = [r.claim_s for r in runs]
    finally:
        ray.shutdown()
        cluster.shutdown()
        with admin.begin() as c:
            c.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()
    double = len(attempts) - len({a.screen_id for a in attempts})
    util_dry = inside / (args.nodes * (dry - first))
    print(f"\nsimulated: {args.nodes} logical GPU nodes, {args.dispatchers} dispatchers x "
          f"{args.nodes // args.dispatchers} workers, {args.screens} screens x {len(runs[0].episodes)} episodes "
          f"of ~{args.mean_s * 1000:.0f} ms, PostgreSQL\n")
    print("| metric | value | target |")
    print("| --- | --- | --- |")
    print(f"| screens done / attempts | {sum(1 for a in attempts if a.status == 'done')} / {len(attempts)} | "
          f"{args.screens} / {args.screens} |")
    print(f"| double claims | {double} | 0 |")
    print(f"| stuck rows (queued or running at the end) | {stuck} | 0 |")
    print(f"| GPU-slot utilisation while screens remain | {100 * util_dry:.1f} % | >= 90 % |")
    print(f"| GPU-slot utilisation over the whole drain | {100 * busy / (args.nodes * wall):.1f} % | |")
    print(f"| drain wall, s | {wall:.1f} | |")
    print(f"| median screen time (first episode -> last record), s | {per_screen:.2f} | |")
    print(f"| screen switch on a worker, ms (last record back -> next screen's first episode handed out), "
          f"median / p90 | {1000 * statistics.median(switch):.1f} / {1000 * pct(switch, .9):.1f} | |")
    print(f"| claim_screen call (PostgreSQL, 4 dispatchers in one process), ms, median / p90 | "
          f"{1000 * statistics.median(claim_s):.1f} / {1000 * pct(claim_s, .9):.1f} | |")
    print(f"| look-ahead claims | {'off' if args.no_look_ahead else 'on'} | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--screens", type=int, default=8)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--continuation", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--dispatchers", type=int, default=4)
    p.add_argument("--mean-s", type=float, default=0.2)
    p.add_argument("--pg-url")
    p.add_argument("--no-look-ahead", action="store_true",
                   help="claim a worker's next screen only once it is idle (the dispatcher before look-ahead claims)")
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child, args.screens, args.prompts, args.continuation)))
    elif args.simulate:
        if args.screens == 8:
            args.screens = 200
        simulate(args)
    else:
        default_mode(args)


if __name__ == "__main__":
    main()
