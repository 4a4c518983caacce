"""Where a dispatcher's start and end go on this machine (issue 13): the CLI import, the database
check, Ray's import and embedded start, one GPU worker actor to ready (its own breakdown), and
Ray's shutdown. Each variant runs in a fresh process, variants alternated:

    python -m bench.startup_probe [--rounds 2] [--variant NAME=ENV=VALUE ...]

PACKBENCH_DB_URL names the database. The default variants compare Ray's default (it prestarts
one Python worker per CPU when the first driver connects) with packbench's embedded default, no
prestart (cluster/runtime.py).
"""

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_VARIANTS = ["prestart=RAY_prestart_worker_first_driver=1", "no-prestart=RAY_prestart_worker_first_driver=0"]


def once() -> dict:
    t0 = time.time()
    import packbench.cli.main  # noqa: F401
    t1 = time.time()
    from packbench.core.settings import Settings
    from packbench.db.store import Store

    Store().check_head()
    t2 = time.time()
    import ray

    t3 = time.time()
    from packbench.cluster.runtime import ensure_ray

    ensure_ray(Settings())
    t4 = time.time()
    from packbench.cluster.worker import start_worker

    actor = start_worker(Settings(), workers_on_host=2)
    env = ray.get(actor.describe.remote())
    t5 = time.time()
    ray.kill(actor)
    ray.shutdown()
    t6 = time.time()
    up = env.get("startup") or {}
    return {"import cli": t1 - t0, "db check": t2 - t1, "import ray": t3 - t2, "ray.init": t4 - t3,
            "worker ready": t5 - t4, "of it spawn": up.get("process_s"), "import": up.get("import_s"),
            "init": up.get("init_s"), "shutdown": t6 - t5, "torch in driver": "torch" in sys.modules}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", action="append", help="NAME or NAME=ENV=VALUE (default: %(default)s)")
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.once:
        print(json.dumps(once()))
        return
    rows = []
    for _ in range(args.rounds):
        for variant in args.variant or DEFAULT_VARIANTS:
            name, _, setting = variant.partition("=")
            env = dict(os.environ)
            if setting:
                key, _, value = setting.partition("=")
                env[key] = value
            out = subprocess.run([sys.executable, "-m", "bench.startup_probe", "--once"], env=env,
                                 capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            rows.append((name, json.loads(lines[-1]) if lines else {"error": out.stderr.strip().splitlines()[-1:]}))
    keys = [k for k in rows[0][1]]
    print(f"{'variant':>12} " + " ".join(f"{k:>12}" for k in keys))
    for name, r in rows:
        print(f"{name:>12} " + " ".join(f"{r.get(k):>12.2f}" if isinstance(r.get(k), float) else f"{str(r.get(k)):>12}"
                                        for k in keys))


if __name__ == "__main__":
    main()
