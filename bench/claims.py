"""Claim throughput of the job queue: N queued screens, D dispatcher processes claiming them
with no engine work, through `Store.claim_screen`, as a dispatcher does.

Usage:  python -m bench.claims [--pg URL] [--screens 1000] [--dispatchers 4] [--sqlite]

PostgreSQL (--pg or $PACKBENCH_TEST_PG_URL, a fresh schema dropped afterwards) and, with
--sqlite, a SQLite file. Target (issue 12): 1,000 screens, 4 dispatchers on PostgreSQL:
0 double claims, >= 200 claims/s. Each dispatcher is a process ('spawn', like Ray's: its
own interpreter and Store), registers itself, waits at a barrier, then claims until the
queue is empty (a claim that comes back empty is retried 3 times: under SKIP LOCKED a claim
can miss rows that other claimers hold for an instant). Claims/s = screens / (the last
claim's end - the barrier). Double claims: screens with more than one attempt, attempts
whose screen another dispatcher also got, and claims beyond the screens queued.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.db import pg_schema, server_version
from packbench.db.store import Store

LEASE_S = 300
NODE = ""  # set by --nodes: each dispatcher claims for a slot on its own node (--same-node: one node)


def node(index: int) -> str:
    if NODE == "same":
        return "node-0"
    return f"node-{index}" if NODE else ""


def dispatcher(url: str, index: int, barrier, results, nodes: bool | str) -> None:
    global NODE
    NODE = "same" if nodes == "same" else ("yes" if nodes else "")
    with Store(url) as store:
        me = store.register_dispatcher(f"bench-{index}", platform.node(), pid=os.getpid())
        store.check_head()
        barrier.wait(timeout=120)
        claimed, misses, last = [], 0, time.time()
        while misses < 3:
            claim = store.claim_screen(me, lease_s=LEASE_S, archive_dir="archives", source_freeze={},
                                       worker=f"w{index}", node=node(index), gpu_name="none", gpu_index=0)
            if claim is None:
                misses += 1
                continue
            claimed.append(claim.screen.id)
            last = time.time()
        results.put((index, claimed, last))


def run(url: str, *, label: str, screens: int, dispatchers: int, nodes: bool) -> None:
    with Store(url) as store:
        store.upgrade()
        protocol = store.put_protocol(sha256="b" * 64, name="claims", canonical_json="{}")
        for i in range(screens):
            store.create_screen(protocol_id=protocol, submitter="bench", priority=i % 3)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(dispatchers + 1)
    results = context.Queue()
    processes = [context.Process(target=dispatcher, args=(url, i, barrier, results, nodes)) for i in range(dispatchers)]
    for process in processes:
        process.start()
    barrier.wait(timeout=120)
    start = time.time()
    reports = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    elapsed = max(last for _, _, last in reports) - start
    every = [s for _, ids, _ in reports for s in ids]
    with Store(url) as store:
        status = store.queue_status()
        attempts = sum(len(store.attempts(s)) for s in range(1, screens + 1))
    doubles = len(every) - len(set(every)) + (attempts - screens)
    per = ", ".join(str(len(ids)) for _, ids, _ in sorted(reports))
    print(f"{label:10}  {screens:,} screens, {dispatchers} dispatchers{' (slots on nodes)' if nodes else ''}: {len(every):,} claims in {elapsed:.2f} s "
          f"= {len(every) / elapsed:,.0f} claims/s; per dispatcher {per}; double claims {doubles}; "
          f"left queued {status.counts['queued']}, running {status.counts['running']}")
    assert doubles == 0 and sorted(every) == list(range(1, screens + 1)), "a screen was claimed twice or never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get("PACKBENCH_TEST_PG_URL"),
                        help="PostgreSQL base URL (default: $PACKBENCH_TEST_PG_URL)")
    parser.add_argument("--screens", type=int, default=1000)
    parser.add_argument("--dispatchers", type=int, default=4)
    parser.add_argument("--sqlite", action="store_true", help="also run on a SQLite file")
    parser.add_argument("--nodes", action="store_true",
                        help="claim for a worker slot on a node (placement filters, shared_node marking); "
                             "every claim stays running, so each node ends up with screens/dispatchers of them")
    parser.add_argument("--same-node", action="store_true",
                        help="with --nodes: every dispatcher claims for a slot on ONE node, so every claim "
                             "waits for the node's lock (claims for a node are serialized: exclusive_node)")
    args = parser.parse_args()
    if args.same_node:
        args.nodes = "same"
    print(f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"Python {platform.python_version()}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    if args.pg:
        print(f"postgresql  server {server_version(args.pg)}")
        with pg_schema(args.pg) as url:
            run(url, label="postgresql", screens=args.screens, dispatchers=args.dispatchers, nodes=args.nodes)
    else:
        print("postgresql  skipped: pass --pg URL or set PACKBENCH_TEST_PG_URL")
    if args.sqlite:
        with tempfile.TemporaryDirectory() as tmp:
            run(f"sqlite:///{Path(tmp) / 'claims.db'}", label="sqlite", screens=args.screens,
                dispatchers=args.dispatchers, nodes=args.nodes)


if __name__ == "__main__":
    main()
