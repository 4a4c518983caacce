"""Results-database benchmark: episode inserts and filtered `results` queries.

Usage:  python -m bench.db [--pg URL] [--episodes 100000] [--inserts 10000]

SQLite always (a fresh file in a temporary directory); PostgreSQL too when --pg or
$PACKBENCH_TEST_PG_URL is given (a fresh schema, dropped afterwards). Targets (issue 5):
10,000 episode inserts <= 2 s on SQLite; a filtered query over 100,000 episodes <= 200 ms on
both backends. Everything goes through `db.store.Store`, as packbench itself does.

Inserts are timed two ways: `put_episode` (one transaction per record, the worker's path:
each record is durable when acknowledged) and `put_episodes` (1,000 records per
transaction, the bulk path). Queries are timed through `Store.results` (SQL plus building
the result rows, the CLI's formatting excluded) as the median of 5 runs after one warm-up,
over a database of --episodes episodes: 50 screens of 2,000 episodes (4 conditions x 500,
warmups included, ~1 % failed), 5 protocols, 3 dtypes, 4 machines, 24 verdicts per attempt.
The database is ANALYZEd after loading (PostgreSQL's autovacuum would do it within minutes).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from packbench.db.queries import GATES, ResultFilter
from packbench.db.store import Store

CONDITIONS = ("dense-stream", "packet", "phase-switched", "row-retention")
DTYPES = ("float32", "float16", "bfloat16")
MODELS = ("models/opt-125m", "models/opt-1.3b", "models/opt-2.7b")
SCREENS = 50
BATCH = 1000


def record(plan_index: int, *, rng: random.Random) -> dict:
    """An episode record shaped like a worker's (8 decode tokens, both phases, memory peaks)."""
    if rng.random() < 0.01:
        return {"plan_index": plan_index, "condition": CONDITIONS[plan_index % 4], "role": "scored",
                "prompt": plan_index // 4, "status": "failed", "error": "CUDA out of memory"}
    h2d = rng.randrange(1 << 20, 1 << 26)
    return {
        "plan_index": plan_index, "condition": CONDITIONS[plan_index % 4],
        "role": "warmup" if plan_index < 8 else "scored", "prompt": plan_index // 4, "status": "ok",
        "error": None, "tokens": [rng.randrange(50272) for _ in range(8)], "wall_s": rng.random(),
        "call_s": rng.random() / 2, "h2d_weight_bytes": h2d, "h2d_index_bytes": h2d // 64, "d2h_bytes": 4096,
        "phases": {"prefill": {"calls": 1, "h2d_bytes": h2d // 2, "call_s": 0.01},
                   "decode": {"calls": 8, "h2d_bytes": h2d - h2d // 2, "call_s": 0.02}},
        "memory": {"peak_allocated_bytes": rng.randrange(1 << 32), "peak_sampled_bytes": rng.randrange(1 << 32)},
    }


def new_attempt(store: Store, *, protocol: int, screen: int, machine: int) -> int:
    screen_id = store.create_screen(protocol_id=store.put_protocol(
        sha256=f"{protocol:02x}" * 32, name=f"bench-{protocol}",
        canonical_json=f'{{"dtype":"{DTYPES[protocol % 3]}","model":{{"path":"{MODELS[protocol % 3]}"}},'
                       f'"name":"bench-{protocol}"}}'),
        submitter="bench")
    machine_id = store.put_machine(host=f"node-{machine}", gpu_name="NVIDIA H200" if machine % 2 else "NVIDIA A100",
                                   driver="570", torch="2.11", cuda="12.8")
    return store.start_attempt(screen_id=screen_id, worker=f"w{screen}", node=f"node-{machine}",
                               gpu_name="NVIDIA H200" if machine % 2 else "NVIDIA A100", gpu_index=0,
                               machine_id=machine_id, source_freeze={}, archive_path=f"archives/{screen_id}.zip").id


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def bench_inserts(store: Store, n: int) -> dict[str, float]:
    rng = random.Random(0)
    records = [record(i, rng=rng) for i in range(n)]
    batched = new_attempt(store, protocol=0, screen=0, machine=0)
    one_by_one = new_attempt(store, protocol=0, screen=1, machine=0)
    return {
        "put_episodes": timed(lambda: [store.put_episodes(batched, records[i:i + BATCH]) for i in range(0, n, BATCH)]),
        "put_episode": timed(lambda: [store.put_episode(one_by_one, r) for r in records]),
    }


def load(store: Store, episodes: int) -> None:
    rng = random.Random(1)
    per_screen = episodes // SCREENS
    for screen in range(SCREENS):
        attempt = new_attempt(store, protocol=screen % 5, screen=screen, machine=screen % 4)
        for start in range(0, per_screen, BATCH):
            store.put_episodes(attempt, [record(i, rng=rng) for i in range(start, min(start + BATCH, per_screen))])
        store.put_verdicts(attempt, [
            {"gate": gate, "condition": condition, "phase": "all", "passed": rng.random() < 0.8,
             "value": rng.random(), "threshold": 0.5, "interval": None, "episodes": [], "detail": ""}
            for gate in GATES for condition in CONDITIONS])
        store.finish_attempt(attempt, status="done", archive_sha256="0" * 64)
    store.analyze()


def queries() -> dict[str, ResultFilter]:
    since = datetime.now(UTC) - timedelta(days=1)
    return {
        "protocol+condition+status": ResultFilter(protocol="bench-3", condition="packet", status="ok"),
        "gate+failed+dtype": ResultFilter(gate="runtime", passed=False, dtype="float16"),
        "machine+model+since, CLI limit": ResultFilter(machine="node-2", model="1.3b", since=since, limit=1001),
        "status=failed (all screens)": ResultFilter(status="failed"),
        "sha prefix+condition+passed": ResultFilter(protocol="01", condition="dense-stream", passed=True),
    }


def bench_queries(store: Store) -> dict[str, tuple[int, float]]:
    out = {}
    for name, f in queries().items():
        rows = len(store.results(f))  # warm-up: caches, compiled statements
        out[name] = (rows, statistics.median(timed(lambda f=f: store.results(f)) for _ in range(5)))
    return out


@contextmanager
def pg_schema(base: str) -> Iterator[str]:
    """A fresh schema on the server at `base`, selected through the connection's search_path."""
    import psycopg

    schema = f"pb_bench_{uuid.uuid4().hex[:12]}"
    conninfo = base.replace("+psycopg", "", 1)
    with psycopg.connect(conninfo, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{base}{'&' if '?' in base else '?'}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(conninfo, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA "{schema}" CASCADE')


def insert_bench(url: str, *, label: str, n: int) -> None:
    with Store(url) as store:
        store.upgrade()
        for method, seconds in bench_inserts(store, n).items():
            print(f"{label:10}  {n:,} inserts via {method:12}  {seconds:6.2f} s  ({seconds / n * 1e3:.3f} ms/episode)")


def sqlite_commit_floor(path: Path, n: int) -> float:
    """Seconds for n bare sqlite3 transactions (BEGIN IMMEDIATE, one small INSERT, COMMIT) in
    WAL mode at synchronous=FULL: what this disk's per-commit fsync costs before any packbench
    code runs, the floor under `put_episode`."""
    import sqlite3

    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, a INT, b INT, pad TEXT, UNIQUE (a, b))")

    def loop() -> None:
        for i in range(n):
            connection.execute("BEGIN IMMEDIATE")
            connection.execute("INSERT INTO t (a, b, pad) VALUES (?, ?, ?) ON CONFLICT DO NOTHING", (1, i, "x" * 300))
            connection.execute("COMMIT")

    seconds = timed(loop)
    connection.close()
    return seconds


def query_bench(url: str, *, label: str, episodes: int) -> None:
    with Store(url) as store:
        store.upgrade()
        seconds = timed(lambda: load(store, episodes))
        print(f"{label:10}  loaded {episodes:,} episodes (put_episodes) in {seconds:.1f} s")
        for name, (rows, seconds) in bench_queries(store).items():
            print(f"{label:10}  query {name:34} {rows:6,} rows  {seconds * 1e3:7.1f} ms")


def server_version(url: str) -> str:
    import psycopg

    with psycopg.connect(url.split("?")[0].replace("+psycopg", "", 1)) as connection:
        return connection.execute("SHOW server_version").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get("PACKBENCH_TEST_PG_URL"),
                        help="PostgreSQL base URL (default: $PACKBENCH_TEST_PG_URL); omit to skip")
    parser.add_argument("--episodes", type=int, default=100_000, help="episodes in the query database")
    parser.add_argument("--inserts", type=int, default=10_000, help="episodes for the insert timing")
    args = parser.parse_args()
    import sqlite3

    print(f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"SQLite {sqlite3.sqlite_version}, {datetime.now(UTC):%Y-%m-%d}")
    # Inserts and queries use separate databases, so the query one holds exactly --episodes.
    with tempfile.TemporaryDirectory() as tmp:
        insert_bench(f"sqlite:///{Path(tmp) / 'inserts.db'}", label="sqlite", n=args.inserts)
        floor = sqlite_commit_floor(Path(tmp) / "floor.db", args.inserts)
        print(f"{'sqlite':10}  {args.inserts:,} bare sqlite3 commits   {floor:6.2f} s  "
              f"({floor / args.inserts * 1e3:.3f} ms each: the disk's fsync floor)")
        query_bench(f"sqlite:///{Path(tmp) / 'queries.db'}", label="sqlite", episodes=args.episodes)
    if not args.pg:
        print("postgresql  skipped: pass --pg URL or set PACKBENCH_TEST_PG_URL")
        return
    print(f"postgresql  server {server_version(args.pg)}")
    with pg_schema(args.pg) as url:
        insert_bench(url, label="postgresql", n=args.inserts)
    with pg_schema(args.pg) as url:
        query_bench(url, label="postgresql", episodes=args.episodes)


if __name__ == "__main__":
    main()
