"""Audit speed: time core.audit.audit_archive on a realistic ~80 MB raw archive, on one core.

Usage:  python -m bench.audit [--archive PATH] [--runs 7]

The archive is built (once, then reused from --archive) by `write_synthetic_screen`: a
schema-2 protocol of an OPT-2.7B-shaped screen (32 layers, vocabulary 50272), 2 conditions x
(1 warmup + 4 prompts x 3 repetitions) = 26 episodes of 16 calls, each with its per-call,
per-layer ledger and float32 logits of shape (16, 50272): the members a real screen writes,
with consistent totals and verdicts, so the audit does all of its work and agrees. No engine
or model is involved; the tests use the same builder at toy sizes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from packbench.core.archive import PLAN_NAME, PROTOCOL_NAME, VERDICTS_NAME, WORKER_NAME, ArchiveWriter
from packbench.core.fidelity import of_episode
from packbench.core.gates import compute_verdicts
from packbench.core.metrics import episode_totals, opt_bytes
from packbench.core.registry import SHAPES, tier_of
from packbench.core.plan import plan, prompts
from packbench.core.protocol import MIB, freeze

INDEX_BYTES = 8


def synthetic_protocol(*, prompts_n: int = 2, repetitions: int = 1, prefix: int = 8, continuation: int = 4,
                       conditions: tuple[str, ...] = ("dense-stream", "packet"), allowance_mib: int = 4800,
                       gates: dict | None = None) -> dict:
    """A schema-2 protocol mapping (not yet frozen) for a synthetic screen: `packet` is the host
    gather, as the synthetic screens written before schema 3 froze it."""
    return {
        "schema": 2,
        "name": "synthetic-screen",
        "model": {"synth": {"shape": "opt-2.7b", "dtype": "float16", "sparsity": 0.94, "seed": 0}},
        "dtype": "float16",
        "prompts": {"generator": {"seed": 0, "count": prompts_n}},
        "prefix_tokens": prefix,
        "continuation_tokens": continuation,
        "conditions": [{"name": c, "policy": c} for c in conditions],
        "reference": conditions[0],
        "warmups": 1,
        "repetitions": repetitions,
        "order": "alternating",
        "allowance_mib": allowance_mib,
        "gates": gates if gates is not None else {
            "faithfulness": {"tolerance": 0.0},
            "resources": {},
            "capacity": {},
            "acquisition": [{"control": conditions[0], "max_ratio": 0.5, "phase": ph}
                            for ph in ("all", "prefill", "decode")],
            "runtime": {"control": conditions[0], "max_ratio": 0.8},
            "useful_latency": {"max_first_episode_s": 30.0, "max_cold_start_s": 60.0},
        },
    }


def _calls(rng: np.random.Generator, policy: str, *, prefix: int, continuation: int, layers: int, hidden: int,
           ffn: int, itemsize: int, batch: int = 1) -> list[dict]:
    """A per-call ledger shaped like engine.ledger.CallLedger.to_dict() (a batch's calls count
    every sequence's tokens)."""
    out = []
    for index in range(continuation):
        phase = "prefill" if index == 0 else "decode"
        if policy == "packet":
            k = rng.integers(ffn // 40, ffn // 4 if phase == "prefill" else ffn // 12, size=layers).tolist()
            active, rows = k, k
            weight = [r * hidden * itemsize for r in rows]
            index_b = [r * INDEX_BYTES for r in rows]
            d2h = list(index_b)
            wall = float(rng.uniform(0.02, 0.03) if phase == "prefill" else rng.uniform(0.004, 0.006))
        else:
            active, rows = [None] * layers, [ffn] * layers
            weight, index_b, d2h = [ffn * hidden * itemsize] * layers, [0] * layers, [0] * layers
            wall = float(rng.uniform(0.20, 0.22) if phase == "prefill" else rng.uniform(0.18, 0.2))
        out.append({"index": index, "phase": phase, "tokens": batch * (prefix if phase == "prefill" else 1), "layers": layers,
                    "active_rows": active, "rows_copied": rows, "h2d_weight_bytes": weight,
                    "h2d_index_bytes": index_b, "d2h_bytes": d2h, "rows_wasted": [0] * layers,
                    "copy_wait_s": [0.0] * layers, "logits_d2h_bytes": 0, "wall_s": wall})
    return out


def write_synthetic_screen(path: Path, raw: dict | None = None, *, vocab: int = 64, layers: int = 2,
                           hidden: int = 8, ffn: int = 64, param_bytes: int | None = None, seed: int = 0,
                           seal: bool = True) -> dict:
    """Write the raw archive of a synthetic screen of protocol `raw` (synthetic_protocol()) the
    way cluster/screen.py does; return {body, entries, episodes, start, verdicts, sha256}.

    All conditions produce the same logits for a prompt (so faithfulness holds); packet moves
    few bytes and is faster; every total is episode_totals() of the ledger. An approximate
    condition's episode (a `quantized` competitor, schema 5) is teacher-forced on the first
    reference episode of its prompt, as engine/worker.py does: its forced logits are the
    prompt's plus a little noise, its record states `tier`, `forced_from` and the `fidelity`
    figures service/screen.py records. A batch (schema 6) stacks its sequences' logits and
    tokens. The records are
    physically possible (docs/archive.md, "Invariants"): a synthetic model's shape sets the
    layers, row bytes and parameter bytes (overriding `layers`, `hidden`, `ffn`), the sampled
    peak has its trace, the manifest's environment is worker.json's.
    """
    raw = raw if raw is not None else synthetic_protocol()
    frozen = freeze(raw)
    body = frozen.body
    entries = plan(body)
    token_ids = prompts(body, vocab=vocab)
    n, prefix = body["continuation_tokens"], body["prefix_tokens"]
    allowance = body["allowance_mib"] * MIB
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[body["dtype"]]
    synth = body["model"].get("synth")
    if synth is not None:
        dims = SHAPES[synth["shape"]]
        layers, hidden, ffn = dims["layers"], dims["hidden"], dims["ffn"]
        sizes = opt_bytes(**dims, dtype=body["dtype"])
        param_bytes = sizes["param_bytes"] if param_bytes is None else param_bytes
    host = layers * hidden * ffn * itemsize
    param_bytes = param_bytes if param_bytes is not None else allowance + 1
    start = {"param_bytes": param_bytes, "device_param_bytes": param_bytes - host, "host_outgoing_bytes": host,
             "cpu_first": True, "allowance_bytes": allowance, "device": "cuda:0"}
    environment = {"host": "synthetic", "device": "cuda:0"}
    policies = {c["name"]: c["policy"] for c in body["conditions"]}
    tiers = {name: tier_of(policy) for name, policy in policies.items()}
    stated = "approximate" in tiers.values()  # records state their tier (as the worker's do) where it matters
    batch = body.get("batch", 1)
    first_reference: dict[int, int] = {}  # prompt -> the reference episode approximate ones are forced on
    w = ArchiveWriter(path)
    w.add_json(PROTOCOL_NAME, body)
    w.add_json(PLAN_NAME, {"entries": entries, "prompts": token_ids})
    w.add_json(WORKER_NAME, {"environment": environment, "start": start,
                               "model_dir": "synthetic"})
    episodes = []
    clock = 5.0  # worker entry to the first episode
    for entry in entries:
        rng = np.random.Generator(np.random.PCG64([seed, entry["index"]]))
        seqs = [np.random.Generator(np.random.PCG64([seed, 1000 + p])).standard_normal((n, vocab), dtype=np.float32)
                for p in entry.get("prompts", [entry["prompt"]])]
        logits = seqs[0] if batch == 1 else np.stack(seqs)
        policy = policies[entry["condition"]]
        calls = _calls(rng, policy, prefix=prefix, continuation=n, layers=layers, hidden=hidden, ffn=ffn,
                       itemsize=itemsize, batch=batch)
        for c in calls:
            c["logits_d2h_bytes"] = batch * vocab * 4  # every sequence's last-position logits
        totals = episode_totals(calls)
        wall = totals["call_s"] + 0.001 * n
        for agg in totals["phases"].values():  # a worker may add a phase wall; the ledger cannot
            agg["wall_s"] = agg["call_s"] + 0.0005 * agg["calls"]
        peak = allowance - 10 * MIB
        record = {"plan_index": entry["index"], "condition": entry["condition"], "role": entry["role"],
                  "prompt": entry["prompt"], "policy": policy, "status": "ok", "error": None,
                  "tokens": _argmax(logits), "wall_s": wall,
                  "first_logit_since_entry_s": clock + calls[0]["wall_s"], **totals,
                  "memory": {"peak_allocated_bytes": peak - MIB, "peak_reserved_bytes": peak,
                             "peak_sampled_bytes": peak + 5 * MIB, "kv_bytes": 4096,
                             "policy_device_bytes": 1 << 20, "host_outgoing_bytes": start["host_outgoing_bytes"]},
                  "calls": calls,
                  "energy_j": float(rng.uniform(20.0, 30.0))}  # a GPU worker's reading (NVML), as "cuda:0" has
        if batch > 1:
            record["prompts"] = entry["prompts"]
        forced = None
        if stated:
            record["tier"] = tiers[entry["condition"]]
        if entry["condition"] == body["reference"]:
            first_reference.setdefault(entry["prompt"], entry["index"])
        elif tiers[entry["condition"]] == "approximate":
            record["forced_from"] = first_reference.get(entry["prompt"])
            if record["forced_from"] is not None:
                forced = logits + np.float32(0.05) * rng.standard_normal(logits.shape, dtype=np.float32)
            by_index = {e["plan_index"]: e for e in episodes}
            try:
                record["fidelity"] = of_episode({**record, "forced_logits": forced}, by_index,
                                                reference=body["reference"]).as_dict()
            except ValueError:
                record["fidelity"] = None
        clock += wall + 0.01
        trace = np.array([[0.0, float(peak)], [0.01, float(peak + 5 * MIB)]], dtype=np.float64)
        w.add_episode(record, logits, trace, forced)
        episodes.append({**record, "logits": logits, "forced_logits": forced})
    verdicts = compute_verdicts(body, episodes, start=start)
    w.add_json(VERDICTS_NAME, verdicts)
    sha = w.seal({"protocol_sha256": frozen.sha256, "screen_id": 1, "attempt": 1,
                  "environment": environment, "source_freeze": {}}) if seal else None
    return {"body": body, "entries": entries, "episodes": episodes, "start": start, "verdicts": verdicts,
            "sha256": sha}


def _argmax(logits: np.ndarray) -> list:
    """Token ids: one list per call's argmax, or a batch's one list per sequence."""
    if logits.ndim == 3:
        return [_argmax(seq) for seq in logits]
    return [int(t) for t in logits.argmax(axis=1)]


def build_bench_archive(path: Path) -> None:
    raw = synthetic_protocol(prompts_n=4, repetitions=3, prefix=512, continuation=16)
    write_synthetic_screen(path, raw, vocab=50272, layers=32, hidden=2560, ffn=10240,
                           param_bytes=5_303_193_600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archive", type=Path, default=Path("/tmp/packbench-bench-audit.zip"),
                    help="reused when it exists, built otherwise")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    if not args.archive.exists():
        t = time.perf_counter()
        build_bench_archive(args.archive)
        print(f"built {args.archive} in {time.perf_counter() - t:.1f} s")
    from packbench.core.audit import audit_archive

    size = args.archive.stat().st_size
    times, digests = [], set()
    for _ in range(args.runs):
        t = time.perf_counter()
        report = audit_archive(args.archive)
        times.append(time.perf_counter() - t)
        digests.add(report.digest)
        assert report.agrees, report.problems
    print(f"archive {size:,} B, {report.record['episodes']} episodes; audit on 1 core "
          f"({platform.processor() or platform.machine()}, Python {platform.python_version()}, numpy {np.__version__})")
    print(f"runs {args.runs}: median {statistics.median(times):.3f} s, min {min(times):.3f} s, "
          f"max {max(times):.3f} s; digests identical: {len(digests) == 1}")


if __name__ == "__main__":
    main()
