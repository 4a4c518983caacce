"""Re-execution audits: the one check of truth (docs/archive.md, "Re-execution audits").

A static audit proves an archive is consistent with itself and with the database; a
consistent forgery (a ledger, a time or a threshold changed everywhere at once) passes it. A
re-execution audit re-runs episodes drawn from the archive on a worker with the same
accelerator, from the same checkpoint (its content digest must equal the archived one), and
compares what it measures with what the archive says:

- exactly: status, tokens, logits (bit for bit), every byte count of the per-call ledger
  (every key of every call that is not a time), the ledger totals, the deterministic memory
  byte counts (KV cache, policy buffers (within one engine buffer layout), pinned,
  host-resident and device-resident parameters) and the start record's parameter bytes;
- statistically, with stated tolerances: per condition, the median episode wall of the re-run
  against the median of the archived episodes of that condition (TIME_FACTOR either way, or
  TIME_SLACK_S apart); the allocator's peak and the sampled peak of each episode
  (PEAK_TOLERANCE relative plus an absolute slack each).

Before anything is compared, the reference condition's drawn episode runs twice on the new
worker: if it does not reproduce itself there, no exactness comparison means anything (on
CUDA the default attention path is not reproducible run to run) and the audit says so.

This module is plain Python: it draws, plans and compares. Running the episodes is the
caller's (service/audit.py through cluster/reexecute.py).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from packbench.core.archive import (
    PLAN_NAME,
    PROTOCOL_NAME,
    WORKER_NAME,
    ArchiveReader,
    episode_members,
    plan_prompts,
    worker_parts,
)
from packbench.core.audit import LOGITS_DTYPE, START_BYTES
from packbench.core.canonical import canonical_json, canonical_sha256
from packbench.core.plan import plan as make_plan
from packbench.core.protocol import expand

REEXECUTE_VERSION = 4  # bump when what a re-execution compares changes: the digest covers it
# 2: policy_device_bytes is compared only between episodes of the same engine buffer layout
# 3: an expert cache's experts section (routing, counts, figures) is compared
# 4: a competitor re-runs its archived placement (`placements`), its offload section is compared,
#    and an episode whose placement the re-executing device cannot hold is `unjudged` (partial)
TIME_FACTOR = 2.0  # re-run median wall within [1/2, 2] x the archived median of its condition ...
TIME_SLACK_S = 0.010  # ... or within 10 ms of it (tiny CPU episodes are all noise)
PEAK_TOLERANCE = {"peak_allocated_bytes": (0.05, 16 << 20), "peak_sampled_bytes": (0.10, 64 << 20)}
EXACT_MEMORY = ("kv_bytes", "policy_device_bytes", "host_outgoing_bytes", "pinned_bytes", "device_param_bytes")
MAX_PROBLEMS_PER_EPISODE = 8
# Keys of an episode's `offload` section that the re-executing worker measures or that say how its
# build came about (besides times, `_s`): not part of the placement it is handed and re-runs.
# device_bytes is torch.cuda.memory_allocated around the build: a library's own buffers (DeepSpeed's
# communicator, cuBLAS workspaces) make it the process's figure, not the placement's, so comparing
# it exactly could call an honest GPU archive DISAGREE; the placement itself and every call's bytes
# are compared.
MEASURED_OFFLOAD = ("state", "held_bytes", "device_bytes")
UNFIT = "PlacementDoesNotFit"  # core/errors.py: the re-executing device cannot hold the archived placement


@dataclass(frozen=True)
class Draw:
    """What to re-run: `episodes` (plan indexes, plan order) and the one the reference repeats."""

    episodes: tuple[int, ...]
    reference_twice: int | None  # plan index of the reference episode run twice (None: no ok reference drawn)
    warmups: tuple[int, ...]  # plan indexes run first and not compared (each drawn condition's first warmup)


def draw(protocol, entries: list[dict], statuses: dict[int, str], k: int, seed: int) -> Draw:
    """K episodes by a seeded draw (numpy PCG64: the same on every machine), at least one per
    condition that has a recorded episode: first one per condition, then the rest from all.

    Finished (`ok`) scored episodes are preferred; a condition with none offers its finished
    warmups, then its failed episodes (a failure must fail again). When K is smaller than the
    number of conditions, every condition still gets one.
    """
    if k < 1:
        raise ValueError("--reexecute K needs K >= 1")
    rng = np.random.Generator(np.random.PCG64(seed))
    recorded = [e for e in entries if e["index"] in statuses]

    def tier(e: dict) -> int:
        ok = statuses[e["index"]] == "ok"
        return 0 if ok and e["role"] == "scored" else 1 if ok else 2

    chosen: list[int] = []
    for name in protocol.condition_names:
        mine = [e for e in recorded if e["condition"] == name]
        if not mine:
            continue
        best = min(tier(e) for e in mine)
        pool = [e["index"] for e in mine if tier(e) == best]
        chosen.append(int(pool[int(rng.integers(len(pool)))]))
    rest = [e["index"] for e in recorded if tier(e) == 0 and e["index"] not in chosen]
    extra = max(0, k - len(chosen))
    if extra and rest:
        picked = rng.choice(len(rest), size=min(extra, len(rest)), replace=False)
        chosen += [int(rest[int(i)]) for i in picked]
    chosen.sort()
    by_index = {e["index"]: e for e in entries}
    reference = next((i for i in chosen if by_index[i]["condition"] == protocol.reference
                      and statuses[i] == "ok"), None)
    drawn_conditions = {by_index[i]["condition"] for i in chosen}
    warmups = []
    for name in protocol.condition_names:
        first = next((e["index"] for e in entries if e["condition"] == name and e["role"] == "warmup"), None)
        if name in drawn_conditions and first is not None and first not in chosen:
            warmups.append(first)
    return Draw(tuple(chosen), reference, tuple(warmups))


def placement_of(offload: Any) -> dict | None:
    """The placement an episode's `offload` section records (FlexGen's policy, DeepSpeed's budget
    and configuration, accelerate's device budget, and what they placed): every key but times and
    MEASURED_OFFLOAD. None where the episode recorded no section (not a competitor)."""
    if not isinstance(offload, dict):
        return None
    return {k: v for k, v in offload.items() if not k.endswith("_s") and k not in MEASURED_OFFLOAD}


def placement_identity(offload: dict) -> str:
    """What tells two handed placements apart (a worker builds a competitor again for another)."""
    return canonical_json(placement_of(offload))


def archived_placements(records: dict[int, dict], indexes) -> dict[int, dict]:
    """Plan index -> the archived `offload` section of each of `indexes` that has one: what the
    re-executing worker is handed, so that a competitor whose placement was chosen from the device
    memory its worker measured (FlexGen's `w_gpu_percent`, DeepSpeed's live parameters and prefetch
    bucket, accelerate's `max_memory`) runs as archived instead of choosing again at a fresh
    worker's context, which would move other bytes and call an honest archive DISAGREE."""
    out = {}
    for i in indexes:
        offload = (records.get(i) or {}).get("offload")
        if isinstance(offload, dict):
            out[i] = offload
    return out


def unjudged(index: int, archived: dict, rerun: dict) -> str | None:
    """One line where episode `index` finished in the archive and its re-run could not place the
    archived placement on this device (UNFIT): not a disagreement, an episode not judged."""
    if archived.get("status") == "ok" and rerun.get("status") == "failed" and _error_type(rerun.get("error")) == UNFIT:
        why = str(rerun.get("error")).partition(":")[2].strip() or "its archived placement does not fit this device"
        return f"episode {index} ({rerun.get('condition')}): not judged: {why}"
    return None


def same_logits(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes()


def _as_f4(a: Any) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(np.asarray(a), dtype=LOGITS_DTYPE)


def _error_type(error: Any) -> str:
    return str(error or "").split(":", 1)[0]


def _within(new: float, old: float, rel: float, slack: float) -> bool:
    return abs(new - old) <= rel * abs(old) + slack


def _ledger_problems(name: str, archived: list, rerun: list) -> list[str]:
    if not isinstance(archived, list) or len(archived) != len(rerun):
        n = len(archived) if isinstance(archived, list) else "no"
        return [f"{name}: the archive has {n} calls, the re-run made {len(rerun)}"]
    out = []
    for a, r in zip(archived, rerun):
        if not isinstance(a, dict):
            out.append(f"{name}: call {r.get('index')} of the archive is not a mapping")
            continue
        for key in sorted(set(a) | set(r)):
            if key.endswith("_s"):  # times: compared statistically, per episode wall
                continue
            if a.get(key) != r.get(key):
                out.append(f"{name}: call {r.get('index')} ({r.get('phase')}) {key}: "
                           f"{_versus(a.get(key), r.get(key))}")
    return out


def _show(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6:
        return f"[{', '.join(map(str, value[:6]))}, ... ({len(value)} values)]"
    return repr(value)


def _versus(archived: Any, rerun: Any) -> str:
    """`archived A, re-executed R`; for lists of one length that `_show` would shorten (a token
    list, a 40-layer ledger field, a batch's token lists), the first values that differ and where,
    since the shortened lists may read alike."""
    at = ""
    while (isinstance(archived, list) and isinstance(rerun, list) and len(archived) == len(rerun)
           and (len(archived) > 6 or any(isinstance(v, list) for v in archived))):
        i = next((i for i, (a, r) in enumerate(zip(archived, rerun)) if a != r), None)
        if i is None:
            break
        at += f"[{i}]"
        archived, rerun = archived[i], rerun[i]
    first = f" at {at}, the first difference" if at else ""
    return f"archived {_show(archived)}, re-executed {_show(rerun)}{first}"


def buffers_layout(record: dict) -> int:
    """The engine's buffer layout an episode ran with (engine/policies.py BUFFERS_LAYOUT; 1 in
    archives made before it was recorded). A newer engine may hold other buffers for the same
    policy (dense-stream's second workspace): those bytes are compared only within one layout."""
    return int((record.get("engine") or {}).get("buffers") or 1)


def compare_episode(index: int, archived: dict, archived_logits: Any, rerun: dict) -> list[str]:
    """What the re-run of plan entry `index` measured that the archive does not say (exact parts
    and the memory peaks; times are compared per condition by `compare_times`)."""
    name = f"episode {index} ({rerun.get('condition')})"
    if archived.get("status") != rerun.get("status"):
        why = f": {rerun.get('error')}" if rerun.get("status") == "failed" else ""
        return [f"{name}: archived status {archived.get('status')!r}, re-executed {rerun.get('status')!r}{why}"]
    if rerun.get("status") != "ok":
        if _error_type(archived.get("error")) != _error_type(rerun.get("error")):
            return [f"{name}: failed with {_error_type(archived.get('error'))!r} in the archive, "
                    f"{_error_type(rerun.get('error'))!r} when re-executed"]
        return []
    out = []
    if archived.get("tokens") != rerun.get("tokens"):
        out.append(f"{name}: tokens differ "
                   f"({_versus(archived.get('tokens'), rerun.get('tokens'))})")
    if not same_logits(_as_f4(archived_logits), _as_f4(rerun.get("logits"))):
        out.append(f"{name}: logits are not bit-identical to the archived ones")
    out += _ledger_problems(name, archived.get("calls"), rerun.get("calls") or [])
    for key in ("h2d_weight_bytes", "h2d_index_bytes", "d2h_bytes", "logits_d2h_bytes", "rows_copied"):
        if archived.get(key) != rerun.get(key):
            out.append(f"{name}: {key} {_versus(archived.get(key), rerun.get(key))}")
    for phase in ("prefill", "decode"):
        a = (archived.get("phases") or {}).get(phase) or {}
        r = (rerun.get("phases") or {}).get(phase) or {}
        for key in sorted(set(a) | set(r)):
            if not key.endswith("_s") and a.get(key) != r.get(key):
                out.append(f"{name}: {phase} {key} archived {_show(a.get(key))}, re-executed {_show(r.get(key))}")
    memory_a, memory_r = archived.get("memory") or {}, rerun.get("memory") or {}
    exact_memory = EXACT_MEMORY if buffers_layout(archived) == buffers_layout(rerun) else \
        tuple(k for k in EXACT_MEMORY if k != "policy_device_bytes")
    for key in exact_memory:
        if memory_a.get(key) != memory_r.get(key):
            out.append(f"{name}: memory {key} archived {_show(memory_a.get(key))}, "
                       f"re-executed {_show(memory_r.get(key))}")
    for key, (rel, slack) in PEAK_TOLERANCE.items():
        a, r = memory_a.get(key), memory_r.get(key)
        if (a is None) != (r is None) or (a is not None and not _within(r, a, rel, slack)):
            out.append(f"{name}: memory {key} archived {_show(a)}, re-executed {_show(r)} "
                       f"(tolerance {rel:.0%} + {slack >> 20} MiB)")
    out += _experts_problems(name, archived.get("experts"), rerun.get("experts"))
    placed, again = placement_of(archived.get("offload")), placement_of(rerun.get("offload"))
    if placed is not None:
        again = json.loads(canonical_json(again)) if again is not None else {}  # tuples as the archive's lists
        out += [f"{name}: offload {key} {_versus(placed[key], again.get(key))}"
                for key in sorted(placed) if placed[key] != again.get(key)]
    if len(out) > MAX_PROBLEMS_PER_EPISODE:
        out = out[:MAX_PROBLEMS_PER_EPISODE] + [f"{name}: ... and {len(out) - MAX_PROBLEMS_PER_EPISODE} more differences"]
    return out


def _experts_problems(name: str, archived: Any, rerun: Any) -> list[str]:
    """An expert cache's section: its routing, what it counted and the figures a replay of that
    routing gives (hit rate, Belady's) follow from the same computation as the logits. Only the
    keys the archived section holds (a newer engine may record more)."""
    if not isinstance(archived, dict):
        return []  # no section to compare (the static audit requires one of an expert cache)
    rerun = json.loads(canonical_json(rerun)) if isinstance(rerun, dict) else {}  # tuples as the archive's lists
    return [f"{name}: experts {key} {_versus(archived[key], rerun.get(key))}"
            for key in sorted(archived) if archived[key] != rerun.get(key)]


def compare_start(archived: Any, rerun: dict) -> list[str]:
    """The checkpoint and its parameter bytes: the same model, placed the same way."""
    archived = archived if isinstance(archived, dict) else {}
    out = []
    if archived.get("model_sha256") is not None and archived.get("model_sha256") != rerun.get("model_sha256"):
        out.append(f"the re-run loaded a checkpoint with digest {rerun.get('model_sha256')}, the archive measured "
                   f"{archived.get('model_sha256')}")
    for key in START_BYTES:
        if archived.get(key) != rerun.get(key):
            out.append(f"start {key}: archived {_show(archived.get(key))}, re-executed {_show(rerun.get(key))}")
    return out


def compare_times(conditions: dict[str, tuple[list[float], list[float]]], factor: float = TIME_FACTOR,
                  ) -> tuple[list[str], dict]:
    """Per condition (archived walls of its finished scored episodes, re-run walls): the medians
    agree within `factor` either way or TIME_SLACK_S. Returns (problems, per-condition medians)."""
    problems, medians = [], {}
    for name, (archived, rerun) in sorted(conditions.items()):
        if not archived or not rerun:
            continue
        a, r = statistics.median(archived), statistics.median(rerun)
        medians[name] = {"archived_s": a, "reexecuted_s": r}
        close = abs(r - a) <= TIME_SLACK_S or (a > 0 and 1 / factor <= r / a <= factor)
        if not close:
            problems.append(f"condition {name}: median episode wall {r:.4f} s re-executed against {a:.4f} s archived "
                            f"(tolerance {factor:g}x or {TIME_SLACK_S * 1e3:g} ms)")
    return problems, medians


def reexecution_record(*, archive_sha256: str | None, protocol_sha256: str | None, seed: int, k: int, drawn: Draw,
                       problems: list[str], accelerator: str, time_factor: float = TIME_FACTOR,
                       placements: int = 0, not_judged: list[str] = ()) -> dict:
    """The audit record of a re-execution. Its digest covers what was drawn and every problem;
    times appear in problems only when out of tolerance (then the digest says so). `placements`:
    how many re-run episodes were handed their archived placement ("archived" in the record, None
    for none); `not_judged`: episodes whose placement this device could not hold (`unjudged`):
    without a problem the result is `partial`, not `agree`."""
    result = "disagree" if problems else "partial" if not_judged else "agree"
    return {"reexecute_version": REEXECUTE_VERSION, "archive_sha256": archive_sha256,
            "protocol_sha256": protocol_sha256, "seed": seed, "k": k, "episodes": list(drawn.episodes),
            "reference_twice": drawn.reference_twice, "accelerator": accelerator, "time_factor": time_factor,
            "placements": "archived" if placements else None, "unjudged": list(not_judged),
            "problems": problems, "result": result}


def record_digest(record: dict) -> str:
    return canonical_sha256(record)


@dataclass
class ArchivedScreen:
    """What a re-execution needs from an archive that passed the static audit."""

    protocol_body: dict
    protocol: Any  # core.protocol.Protocol
    entries: list[dict]
    prompts: list[list[int]]
    environment: dict
    start: dict
    model_dir: str | None
    records: dict[int, dict]  # plan index -> record (every recorded episode)


def read_archived(path) -> ArchivedScreen:
    """Read the members a re-execution compares against (call after a static audit: the members
    are then known to be the manifest's, well formed and within the bounds)."""
    with ArchiveReader(path) as reader:
        body = reader.read_json(PROTOCOL_NAME)
        plan = reader.read_json(PLAN_NAME)
        worker = reader.read_json(WORKER_NAME)
        protocol = expand(body)
        entries = make_plan(protocol)  # the protocol's own plan (the static audit compared plan.json with it)
        names = set(reader.names)
        records = {e["index"]: reader.read_json(episode_members(e["index"]).record) for e in entries
                   if episode_members(e["index"]).record in names}
    prompts = plan_prompts(plan)
    if (not isinstance(prompts, list) or len(prompts) != protocol.prompt_count
            or not all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompts)):
        raise ValueError("plan.json's prompts are not one list of token ids per prompt")
    records = {i: r for i, r in records.items() if isinstance(r, dict)}
    parts = worker_parts(worker)
    return ArchivedScreen(body, protocol, entries, prompts, parts.get("environment") or {},
                          parts.get("start") or {}, parts.get("model_dir"), records)


def read_logits(path, indexes, *, batch: int = 1) -> dict:
    """The archived logits of the given plan entries, in one pass over the archive (None where
    absent): (calls, vocab) each, or at a `batch` above 1 (sequences, calls, vocab)."""
    ndim = 2 if batch == 1 else 3
    with ArchiveReader(path) as reader:
        names = set(reader.names)
        return {i: reader.read_array(episode_members(i).logits, dtype=LOGITS_DTYPE, ndim=ndim)
                if episode_members(i).logits in names else None for i in indexes}
