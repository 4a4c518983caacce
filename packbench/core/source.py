"""Source freeze: which code produced a screen (as MLPerf LoadGen records its sources)."""

import hashlib
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FROZEN_PACKAGES = ("engine", "core")  # the code whose behaviour decides records and verdicts


def source_sha256(root: Path = ROOT) -> str:
    """SHA-256 over the relative path and bytes of every .py file of the frozen packages."""
    h = hashlib.sha256()
    for pkg in FROZEN_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_freeze() -> dict:
    try:
        version = metadata.version("packbench")
    except metadata.PackageNotFoundError:
        version = "unknown"
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"package_version": version, "git_commit": commit or "",
            "git_dirty": bool(status) if status is not None else None,
            "engine_sha256": source_sha256()}
