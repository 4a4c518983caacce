"""A consistent forgery of one episode's byte ledger, as a forger without the signing key makes it.

Usage:  python -m bench.forge ARCHIVE OUT [--episode N] [--rows 1]

The forged episode (default: the first finished scored `packet`-like episode that copied rows in a
decode call, i.e. not the reference) claims `--rows` fewer copied rows in one decode call's
first copying layer, and that many rows' bytes fewer moved. Its totals, the phase totals and
verdicts.json are recomputed to match, every other member is copied as it is, and a new
manifest is sealed over them: the static audit finds nothing (no database, no key), and the
old signature (if any) no longer matches, so the archive goes out unsigned. Only a
re-execution of that episode can tell. Prints the forged episode's plan index.

Used by tests/cluster/test_submit_audit.py and bench/reexecute_device.sh (issue 10's GPU check).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from packbench.core.archive import MANIFEST_NAME, PROTOCOL_NAME, VERDICTS_NAME, WORKER_NAME, ArchiveReader, ArchiveWriter, episode_members
from packbench.core.canonical import canonical_json
from packbench.core.gates import compute_verdicts
from packbench.core.metrics import episode_totals
from packbench.core.protocol import expand
from packbench.core.reexecute import read_logits


def _target(call_rows: list, call_bytes: list) -> int | None:
    return next((layer for layer, rows in enumerate(call_rows) if rows > 0 and call_bytes[layer] > 0), None)


def _forgeable(rec: dict, reference: str) -> bool:
    return (rec.get("status") == "ok" and rec.get("condition") != reference
            and any(c["phase"] == "decode" and _target(c["rows_copied"], c["h2d_weight_bytes"]) is not None
                    for c in rec.get("calls", [])))


def forge_ledger(src: Path, dst: Path, *, episode: int | None = None, rows: int = 1) -> int:
    """Write `dst`: `src` with one episode's ledger forged consistently. Returns its plan index."""
    with ArchiveReader(src) as reader:
        data = {name: reader.read_bytes(name) for name in reader.names}
    protocol = expand(json.loads(data[PROTOCOL_NAME]))
    records = {int(n.split("/")[1].split(".")[0]): json.loads(raw) for n, raw in data.items()
               if n.startswith("episodes/")}
    if episode is None:
        candidates = [i for i, r in sorted(records.items()) if _forgeable(r, protocol.reference)]
        scored = [i for i in candidates if records[i].get("role") == "scored"]
        episode = (scored or candidates)[0]
    rec = records[episode]
    call = next(c for c in rec["calls"] if c["phase"] == "decode" and _target(c["rows_copied"], c["h2d_weight_bytes"])
                is not None)
    layer = _target(call["rows_copied"], call["h2d_weight_bytes"])
    row_bytes = call["h2d_weight_bytes"][layer] // call["rows_copied"][layer]
    rows = min(rows, call["rows_copied"][layer])
    call["rows_copied"][layer] -= rows
    call["h2d_weight_bytes"][layer] -= rows * row_bytes
    totals = episode_totals(rec["calls"])
    for key, value in totals.items():
        if isinstance(value, dict):  # phases
            for phase, sub in value.items():
                rec.setdefault("phases", {}).setdefault(phase, {}).update(
                    {k: v for k, v in sub.items() if not k.endswith("_s")})
        elif not key.endswith("_s") and key in rec:
            rec[key] = value
    data[episode_members(episode).record] = canonical_json(rec)
    logits = read_logits(src, sorted(records))
    episodes = [{**r, "logits": logits[i]} for i, r in sorted(records.items())]
    start = json.loads(data[WORKER_NAME]).get("start")
    data[VERDICTS_NAME] = canonical_json(compute_verdicts(protocol, episodes, start=start))
    manifest = json.loads(data[MANIFEST_NAME])
    writer = ArchiveWriter(dst)
    for name, raw in data.items():
        if name != MANIFEST_NAME:
            writer.add_bytes(name, raw)
    writer.seal({k: v for k, v in manifest.items() if k not in ("members", "format_version")})
    return episode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--episode", type=int, default=None)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    print(forge_ledger(args.archive, args.out, episode=args.episode, rows=args.rows))


if __name__ == "__main__":
    main()
