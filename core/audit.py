"""The auditor: re-read a raw archive, recompute every metric and verdict from raw records
alone (no inference), and compare with what the archive and the database say.

The audit record excludes where and when it ran, so its digest (SHA-256 of its canonical
JSON) is the same for every audit of the same archive against the same database rows.
"""

from dataclasses import dataclass
from pathlib import Path

from core.archive import ArchiveReader, file_sha256
from core.canonical import canonical_json, canonical_sha256
from core.errors import ArchiveError
from core.gates import compute_verdicts
from core.metrics import episode_totals

VERDICT_KEYS = ("gate", "condition", "phase", "passed", "value", "threshold", "interval")
EPISODE_KEYS = ("condition", "role", "prompt", "status", "tokens", "h2d_weight_bytes", "h2d_index_bytes", "d2h_bytes")


@dataclass(frozen=True)
class AuditReport:
    record: dict  # archive_sha256, protocol_sha256, complete, problems, verdicts, result

    @property
    def agrees(self) -> bool:
        return self.record["result"] == "agree"

    @property
    def digest(self) -> str:
        return canonical_sha256(self.record)

    @property
    def problems(self) -> list[str]:
        return self.record["problems"]


def _key(v: dict) -> tuple:
    return (v["gate"], v["condition"], v["phase"])


def _compare_verdicts(mine: list[dict], theirs: list[dict], where: str) -> list[str]:
    """Differences between recomputed verdicts and stored ones, one line each."""
    a = {_key(v): {k: v.get(k) for k in VERDICT_KEYS} for v in mine}
    b = {_key(v): {k: v.get(k) for k in VERDICT_KEYS} for v in theirs}
    out = [f"{where} lacks verdict {'/'.join(k)}" for k in sorted(set(a) - set(b))]
    out += [f"{where} has an extra verdict {'/'.join(k)}" for k in sorted(set(b) - set(a))]
    for k in sorted(set(a) & set(b)):
        if canonical_json(a[k]) != canonical_json(b[k]):
            diff = [f for f in VERDICT_KEYS if a[k][f] != b[k][f]]
            out.append(f"{where} verdict {'/'.join(k)} differs in {', '.join(diff)}: "
                       f"recomputed {[a[k][f] for f in diff]} vs stored {[b[k][f] for f in diff]}")
    return out


def _named_members(problems: list[str], names: list[str]) -> set[str]:
    """Members that a verify() problem line names: they are not trusted for recomputation."""
    words = {w.strip("(),:;") for p in problems for w in p.split()}
    return {n for n in names if n in words}


def audit_archive(path: Path, *, expected_sha256: str | None = None, db_verdicts: list[dict] | None = None,
                  db_episodes: list[dict] | None = None) -> AuditReport:
    """Audit one archive. `expected_sha256`, `db_verdicts` and `db_episodes` come from the
    database when it is at hand; every one given must agree for the result to be "agree".
    """
    path = Path(path)
    problems: list[str] = []
    sha = file_sha256(path) if path.is_file() else None
    if sha is None:
        raise ArchiveError(f"no archive at {path}; check the path (or the attempt's archive_path in the database)")
    if expected_sha256 is not None and sha != expected_sha256:
        problems.append(f"archive SHA-256 {sha} differs from the database's {expected_sha256}")
    reader = ArchiveReader(path)
    problems += reader.verify()
    record = {"archive_sha256": sha, "protocol_sha256": None, "complete": reader.complete,
              "episodes": 0, "verdicts": [], "problems": problems, "result": "disagree"}
    readable = set(reader.names) - _named_members(problems, reader.names)
    try:
        body = reader.read_json("protocol.json")
        plan = reader.read_json("plan.json")
    except ArchiveError as e:
        problems.append(f"cannot recompute: {e}")
        return AuditReport(record)
    record["protocol_sha256"] = canonical_sha256(body)
    if reader.manifest is not None and reader.manifest.get("protocol_sha256") != record["protocol_sha256"]:
        problems.append("manifest protocol_sha256 does not match protocol.json")
    episodes: list[dict] = []
    for entry in plan["entries"]:
        i = entry["index"]
        name, logits_name = f"episodes/{i:05d}.json", f"logits/{i:05d}.npy"
        if name not in readable:
            problems.append(f"episode {i} has no readable record ({name})")
            continue
        rec = reader.read_json(name)
        if (rec["condition"], rec["role"], rec["prompt"]) != (entry["condition"], entry["role"], entry["prompt"]):
            problems.append(f"{name} does not match plan entry {i}")
        logits = reader.read_array(logits_name) if logits_name in readable else None
        if rec.get("status") == "ok":
            totals = episode_totals(rec["calls"])
            for k, v in totals.items():
                if rec.get(k) != v:
                    problems.append(f"{name}: stored {k} {rec.get(k)!r} != {v!r} recomputed from its call ledger")
            if logits is None or logits.shape[0] != len(rec["calls"]) or len(rec["tokens"]) != len(rec["calls"]):
                problems.append(f"{name}: logits/tokens do not cover every call")
            elif [int(t) for t in logits.argmax(axis=1)] != rec["tokens"]:
                problems.append(f"{name}: tokens are not the argmax of the stored logits")
        episodes.append({**rec, "logits": logits})
    record["episodes"] = len(episodes)
    verdicts = compute_verdicts(body, episodes)
    record["verdicts"] = [{k: v[k] for k in VERDICT_KEYS} for v in verdicts]
    if "verdicts.json" in readable:
        problems += _compare_verdicts(verdicts, reader.read_json("verdicts.json"), "archive")
    if db_verdicts is not None:
        problems += _compare_verdicts(verdicts, db_verdicts, "database")
    if db_episodes is not None:
        stored = {e["plan_index"]: e for e in db_episodes}
        for e in episodes:
            row = stored.get(e["plan_index"])
            if row is None:
                problems.append(f"database lacks episode {e['plan_index']}")
                continue
            for k in EPISODE_KEYS:
                if e.get(k) is not None and row.get(k) != e.get(k):
                    problems.append(f"database episode {e['plan_index']} {k} {row.get(k)!r} != archive {e.get(k)!r}")
        for i in sorted(set(stored) - {e["plan_index"] for e in episodes}):
            problems.append(f"database has episode {i} that the archive lacks")
    if not reader.complete:
        problems.append("archive is incomplete: the screen did not seal it")
    record["result"] = "agree" if not problems else "disagree"
    return AuditReport(record)
