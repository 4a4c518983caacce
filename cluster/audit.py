"""Audit jobs on the cluster: the auditor as a Ray task on any node that can read the archive."""

from __future__ import annotations

from pathlib import Path

from cluster.runtime import ensure_ray
from core.audit import AuditReport, audit_archive
from core.settings import Settings


def audit_on_cluster(path: Path, *, settings: Settings, **compare) -> AuditReport:
    """Run `core.audit.audit_archive` as a CPU-only Ray task (no GPU is held for an audit)."""
    ray = ensure_ray(settings)
    task = ray.remote(num_cpus=1, num_gpus=0, max_retries=0)(audit_archive)
    return ray.get(task.remote(Path(path), **compare))
