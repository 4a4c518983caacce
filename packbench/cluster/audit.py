"""Audit jobs on the cluster: one CPU task per archive, fanned out with a concurrency limit.

No shared filesystem is assumed. A task first looks for the archive at its path on the node it
runs on; when it is not there, the driver ships the bytes through Ray's object store (read by
the driver, or by a small task on the node that produced the archive) and the task audits a
private copy. `other_node` places each audit on a node other than the producer's; `repeat`
runs each audit that many times on distinct nodes (their digests must agree).
"""

from __future__ import annotations

import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packbench.cluster.runtime import ensure_ray
from packbench.core.audit import AuditReport, audit_archive
from packbench.core.provenance import signature_path
from packbench.core.settings import Settings


@dataclass
class AuditJob:
    """One archive to audit and what it must agree with (`compare`: core.audit keyword args)."""

    key: Any  # the caller's handle (an attempt id)
    path: str
    producer_node: str | None = None  # Ray node id that wrote the archive, if known
    compare: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AuditDone:
    job: AuditJob
    report: AuditReport | None  # None: the archive could not be read anywhere (`error` says why)
    node: str  # Ray node id the audit ran on
    host: str
    shipped: bool  # the archive's bytes travelled through the object store
    error: str | None = None


def _audit_here(path: str, data: bytes | None, compare: dict, signature: bytes | None = None) -> dict:
    """Runs on the auditing node. Without the file and without bytes: says so (the driver ships them,
    and the detached signature beside them when the audit checks one)."""
    import ray

    where = {"node": ray.get_runtime_context().get_node_id(), "host": platform.node()}
    p = Path(path)
    if p.is_file():
        return {**where, **_report(audit_archive(p, **compare)), "shipped": False}
    if data is None:
        return {**where, "missing": True}
    with tempfile.TemporaryDirectory(prefix="packbench-audit-") as tmp:
        copy = Path(tmp) / p.name
        copy.write_bytes(data)
        if signature is not None:
            signature_path(copy).write_bytes(signature)
        report = _report(audit_archive(copy, **compare))
    # Problems name no path (the auditor scrubs its own), so the digest equals a local audit's.
    return {**where, **report, "shipped": True}


def _report(report: AuditReport) -> dict:
    return {"record": report.record, "unreadable": report.unreadable, "partial": report.partial,
            "rows_pending": report.rows_pending, "details": report.details, "tiers": report.tiers}


def _read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def _read_if_there(path: str) -> bytes | None:
    return Path(path).read_bytes() if Path(path).is_file() else None


def _cpu_nodes(ray) -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1]


def _pick_nodes(nodes: list[str], producer: str | None, *, other_node: bool, repeat: int, turn: int) -> list[str | None]:
    """`repeat` distinct nodes for one job (None: let Ray choose), avoiding the producer if asked."""
    pool = [n for n in nodes if not (other_node and n == producer)] or ([] if other_node else nodes)
    if other_node and not pool:
        raise ValueError("no node other than the archive's producer can run the audit")
    if repeat > 1 and len(pool) < repeat:
        raise ValueError(f"--repeat {repeat} needs {repeat} distinct nodes; the cluster has {len(pool)} eligible")
    if not other_node and repeat == 1:
        return [None]
    start = turn % len(pool)
    rotated = pool[start:] + pool[:start]
    return rotated[:repeat]


def audit_on_cluster(path: Path, *, settings: Settings, **compare) -> AuditReport:
    """One archive as one CPU-only Ray task (the `audit --ray` of a single archive)."""
    (done,) = fan_out([AuditJob(key=None, path=str(path), compare=compare)], settings=settings, other_node=False)
    if done.report is None:
        from packbench.core.errors import ArchiveError

        raise ArchiveError(done.error)
    return done.report


def fan_out(jobs: list[AuditJob], *, settings: Settings, concurrency: int = 8, other_node: bool | None = None,
            repeat: int = 1, progress=None) -> list[AuditDone]:
    """Audit every job on the cluster, at most `concurrency` tasks at once; results in job order,
    `repeat` per job. `other_node` None: on when the cluster has more than one node.
    `progress(done, total)` hears each finished audit (cli/progress.py steps)."""
    ray = ensure_ray(settings)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = _cpu_nodes(ray)
    if other_node is None:
        other_node = len(nodes) > 1
    task = ray.remote(num_cpus=1, num_gpus=0, max_retries=0)(_audit_here)
    reader = ray.remote(num_cpus=0, num_gpus=0, max_retries=0)(_read_bytes)
    sig_reader = ray.remote(num_cpus=0, num_gpus=0, max_retries=0)(_read_if_there)

    def submit(job: AuditJob, node: str | None, data=None, signature=None):
        options = {} if node is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        return task.options(**options).remote(job.path, data, job.compare, signature)

    def shipped_signature(job: AuditJob):
        """The archive's detached signature, where the audit checks one (without it a shipped copy
        would read as unsigned)."""
        sig = str(signature_path(Path(job.path)))
        if job.compare.get("trust") is None:
            return None
        if Path(job.path).is_file() or job.producer_node not in nodes:
            return ray.put(_read_if_there(sig))
        return sig_reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(job.producer_node,
                                                                                     soft=False)).remote(sig)

    def shipped_bytes(job: AuditJob):
        if Path(job.path).is_file():
            return ray.put(Path(job.path).read_bytes())
        if job.producer_node in nodes:  # the producer's local disk holds it
            return reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(job.producer_node,
                                                                                     soft=False)).remote(job.path)
        return ray.put(None)  # nobody can read it: the audit reports the archive missing

    todo = [(i, r, job, node) for i, job in enumerate(jobs)
            for r, node in enumerate(_pick_nodes(nodes, job.producer_node if job.producer_node in nodes else None,
                                                  other_node=other_node, repeat=repeat, turn=i))]
    results: dict[tuple[int, int], AuditDone] = {}
    total = len(todo)
    if progress is not None:
        progress(0, total)
    inflight: dict[Any, tuple[int, int, AuditJob, str | None, bool]] = {}
    while todo or inflight:
        while todo and len(inflight) < concurrency:
            i, r, job, node = todo.pop(0)
            inflight[submit(job, node)] = (i, r, job, node, False)
        ready, _ = ray.wait(list(inflight), num_returns=1)
        i, r, job, node, with_bytes = inflight.pop(ready[0])
        out = ray.get(ready[0])
        if out.get("missing") and not with_bytes:
            inflight[submit(job, out["node"], shipped_bytes(job), shipped_signature(job))] = (i, r, job, out["node"], True)
            continue
        if out.get("missing"):
            results[(i, r)] = AuditDone(job, None, out["node"], out["host"], False,
                                        f"no archive at {job.path} on any node that could ship it; check the "
                                        f"attempt's archive_path and that its node is alive")
            if progress is not None:
                progress(len(results), total)
            continue
        results[(i, r)] = AuditDone(job, AuditReport(out["record"], unreadable=out.get("unreadable", False),
                                                        partial=out.get("partial", False),
                                                        rows_pending=out.get("rows_pending", False),
                                                        details=out.get("details", {}),
                                                        tiers=out.get("tiers", {})),
                                    out["node"], out["host"], out["shipped"])
        if progress is not None:
            progress(len(results), total)
    return [results[k] for k in sorted(results)]
