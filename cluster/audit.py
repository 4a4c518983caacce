"""Audit jobs on the cluster: the auditor as a Ray task on any node that can read the archive."""

from pathlib import Path

from cluster.runtime import ensure_ray
from core.audit import AuditReport, audit_archive


def audit_on_cluster(path: Path, *, address: str | None = None, **compare) -> AuditReport:
    """Run `core.audit.audit_archive` as a CPU-only Ray task (no GPU is held for an audit)."""
    ray = ensure_ray(address)
    task = ray.remote(num_cpus=1, num_gpus=0, max_retries=0)(audit_archive)
    return ray.get(task.remote(Path(path), **compare))
