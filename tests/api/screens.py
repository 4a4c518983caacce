"""A results database made from a real archive (tests/data/quickstart-v1.zip), without Ray.

`ingest_archive` records an archive's screen as `packbench ingest` does (Store.ingest_attempt),
minus the signature check, and lets a test change what the worker recorded: the source commit
(`core/source.py`'s `git_commit`) and the episodes' times, to stand for the same protocol
screened at other versions of the code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from packbench.core.archive import PROTOCOL_NAME, VERDICTS_NAME, ArchiveReader, file_sha256
from packbench.core.canonical import canonical_json
from packbench.db.store import Store

DATA = Path(__file__).resolve().parents[1] / "data"
QUICKSTART = DATA / "quickstart-v1.zip"


def archived(path: Path = QUICKSTART) -> tuple[dict, list[dict], list[dict], dict]:
    """(protocol body, episode records, verdicts, manifest) of an archive."""
    with ArchiveReader(path) as r:
        body = r.read_json(PROTOCOL_NAME)
        names = set(r.names)
        records = [r.read_json(n) for n in sorted(names) if n.startswith("episodes/") and n.endswith(".json")]
        return body, records, r.read_json(VERDICTS_NAME), dict(r.manifest or {})


def ingest_archive(store: Store, path: Path, *, commit: str | None = None,
                   edit: Callable[[dict], dict] = lambda rec: rec, key: str = "") -> int:
    """Record the archive at `path` as one done screen; return its id. `commit` replaces the
    recorded source commit; `edit` maps each episode record (its times, say); `key` makes the
    stored archive SHA-256 unique when one file stands for several screens."""
    body, records, verdicts, manifest = archived(path)
    freeze = dict(manifest.get("source_freeze") or {})
    if commit is not None:
        freeze["git_commit"] = commit
    sha = manifest["protocol_sha256"]
    row = store.ingest_attempt(
        protocol_sha256=sha, protocol_name=body["name"], protocol_json=canonical_json(body).decode(),
        machine={"host": "ci-box", "gpu_name": "cpu"},
        attempt={"archive_path": str(path), "archive_sha256": file_sha256(path)[:48] + key.rjust(16, "0"),
                 "source_freeze": freeze, "ingested_from": "tests/api", "node": "ci-box"},
        episodes=[edit(dict(r)) for r in records], verdicts=verdicts)
    return row.screen_id
