"""Many writer processes on one attempt: every row lands exactly once, nobody fails.

8 processes ('spawn', like Ray workers: nothing inherited) each send 500 episode records
and 50 verdicts for the same attempt. Neighbouring processes overlap by 50 plan indexes
and 10 verdict keys, each sends in a shuffled order and re-sends some of its own records,
so the upserts race for real. SQLite serializes writers through its lock (busy_timeout);
PostgreSQL resolves the races with ON CONFLICT.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import traceback

import pytest

from packbench.db.store import Store

PROCESSES = 8
EPISODES_PER_PROCESS = 500
EPISODE_STRIDE = 450  # process i sends plan indexes [450 i, 450 i + 500): 50 overlap the next
VERDICTS_PER_PROCESS = 50
VERDICT_STRIDE = 40
VERDICT_BATCH = 10
RESENT = 10  # each process re-sends its first records at the end


def episode_record(plan_index: int) -> dict:
    return {
        "plan_index": plan_index, "condition": "packet" if plan_index % 2 else "dense-stream",
        "role": "scored", "prompt": plan_index % 7, "status": "ok", "error": None,
        "tokens": [plan_index, plan_index + 1], "wall_s": 0.01, "call_s": 0.01,
        "h2d_weight_bytes": plan_index, "h2d_index_bytes": 1, "d2h_bytes": 2,
        "phases": {"prefill": {"h2d_bytes": 3, "call_s": 0.001}, "decode": {"h2d_bytes": 4, "call_s": 0.002}},
        "memory": {"peak_allocated_bytes": 10, "peak_sampled_bytes": 11},
    }


def gate_verdict(k: int) -> dict:
    return {"gate": f"gate-{k:04d}", "condition": "packet", "phase": "all", "passed": k % 3 != 0,
            "value": float(k), "threshold": 1.0, "interval": None, "episodes": [k], "detail": ""}


def writer(url: str, attempt_id: int, index: int, barrier, results) -> None:
    """One writer process; reports (index, episodes inserted, verdicts inserted) or an error."""
    try:
        rng = random.Random(index)
        plan = list(range(index * EPISODE_STRIDE, index * EPISODE_STRIDE + EPISODES_PER_PROCESS))
        rng.shuffle(plan)
        keys = list(range(index * VERDICT_STRIDE, index * VERDICT_STRIDE + VERDICTS_PER_PROCESS))
        rng.shuffle(keys)
        with Store(url) as store:
            store.check_head()
            barrier.wait(timeout=60)  # start writing together, after the imports
            episodes = sum(store.put_episode(attempt_id, episode_record(i)) for i in plan + plan[:RESENT])
            verdicts = 0
            for start in range(0, len(keys), VERDICT_BATCH):
                batch = [gate_verdict(k) for k in keys[start:start + VERDICT_BATCH]]
                verdicts += store.put_verdicts(attempt_id, batch)
        results.put((index, episodes, verdicts))
    except BaseException:
        results.put((index, "error", traceback.format_exc()))
        raise


@pytest.mark.timeout(180)
def test_concurrent_writers_store_every_row_exactly_once(store, db_url):
    protocol_id = store.put_protocol(sha256="f" * 64, name="load", canonical_json="{}")
    screen_id = store.create_screen(protocol_id=protocol_id, submitter="load")
    attempt = store.start_attempt(
        screen_id=screen_id, worker="w", node="n", gpu_name="g", gpu_index=0,
        machine_id=None, source_freeze={}, archive_path="a.zip",
    )
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    processes = [
        context.Process(target=writer, args=(db_url, attempt.id, i, barrier, results))
        for i in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    reports = []
    try:
        for _ in processes:
            reports.append(results.get(timeout=150))
    except queue.Empty:
        pytest.fail(f"only {len(reports)} of {PROCESSES} writers reported: {reports}")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [report[2] for report in reports if report[1] == "error"]
    assert not errors, errors[0]
    assert [process.exitcode for process in processes] == [0] * PROCESSES

    expected_plan = set(range((PROCESSES - 1) * EPISODE_STRIDE + EPISODES_PER_PROCESS))
    expected_gates = {f"gate-{k:04d}" for k in range((PROCESSES - 1) * VERDICT_STRIDE + VERDICTS_PER_PROCESS)}
    episodes = store.episodes(attempt.id)
    verdicts = store.verdicts(attempt.id)
    assert [e.plan_index for e in episodes] == sorted(expected_plan)  # each exactly once
    assert sorted(v.gate for v in verdicts) == sorted(expected_gates)
    # Exactly one writer was told "inserted" for each row; every duplicate was told "already there".
    assert sum(report[1] for report in reports) == len(expected_plan)
    assert sum(report[2] for report in reports) == len(expected_gates)
    assert all(e.tokens == (e.plan_index, e.plan_index + 1) for e in episodes)
