"""The auditor: re-read a raw archive, recompute every metric and verdict from raw records
alone (no inference), and compare with what the archive and the database say.

What is checked (each finding is one line in `problems`, naming the member or episode):

- the archive file's SHA-256 against the database's, and every member against the manifest
  (ArchiveReader.verify: missing, extra, altered, unreadable, unsafe members);
- protocol.json is a frozen protocol (it re-validates to itself) whose hash the manifest holds;
- plan.json is the plan of that protocol, and its prompts are the protocol's prompts;
- every planned episode has a record that matches its plan entry; a finished one has a
  well-formed call ledger, one call per continuation token (prefill first), totals equal to
  those recomputed from the ledger, tokens that are the argmax of its stored logits and each
  call's logits read-back bytes those logits' (batch x vocab x 4); with
  separate passes, both passes' figures (core/passes.py); an expert cache's or forecast's hits,
  waste and Belady bound replayed from its recorded routing (core/expert_cache.py);
- the verdicts recomputed from those records (with worker.json's start record) equal
  verdicts.json and the database's; the database's episodes equal the archive's.

An unsealed archive (an interrupted screen) is audited as far as it goes and reported as
incomplete. The audit record holds no time, host or path, and every number in it is computed
deterministically, so its digest (SHA-256 of its canonical JSON) is the same for every audit
of the same archive against the same database rows, on any machine.
"""

from __future__ import annotations

import io
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packbench.core.archive import reader as archive_reader
from packbench.core.archive import (
    FIXED_MEMBERS,
    MANIFEST_NAME,
    PLAN_NAME,
    PROTOCOL_NAME,
    VERDICTS_NAME,
    WORKER_NAME,
    ArchiveReader,
    ArchiveTooLarge,
    episode_members,
    file_sha256,
    plan_entries,
    plan_prompts,
    worker_parts,
)
from packbench.core.canonical import canonical_json, canonical_sha256, sha256_hex
from packbench.core.conditions.base import RecordContext
from packbench.core.errors import ArchiveError, ProtocolError
from packbench.core.fidelity import of_episode
from packbench.core.gates import compute_verdicts
from packbench.core.metrics import (
    episode_totals,
    ledger_problems,
    opt_bytes,
    row_bytes_problems,
    stored_total_problems,
    wall_problems,
)
from packbench.core.expert_cache import figure_problems
from packbench.core.moe import is_moe_shape, moe_config
from packbench.core.passes import pass_problems
from packbench.core.provenance import check_signature, signature_path
from packbench.core.plan import plan as make_plan
from packbench.core.plan import prompts as make_prompts
from packbench.core.protocol import Protocol, expand
from packbench.core.protocol.schema import MAX_BATCH, MAX_CONTINUATION
from packbench.core.record import AUDITED, FIELDS_BY_NAME, token_count
from packbench.core.registry import INT8_SCALE_BYTES, SHAPES, kind_of, shape_config, weights_of
from packbench.core.text import one_line

# An archived trace of active sets (docs/traces.md) is read with each of its members at most this
# (16 MiB compressed in the archive may inflate; the trace format's own bounds are for files).
ACTIVE_SETS_CAP = 64 << 20
LOGITS_DTYPE, TRACE_DTYPE = "<f4", "<f8"  # docs/archive.md: little-endian float32 logits, float64 traces
START_BYTES = ("param_bytes", "device_param_bytes", "host_outgoing_bytes")

AUDIT_VERSION = 2  # bump when what an audit checks changes: the digest covers it
VERDICT_KEYS = ("gate", "condition", "phase", "passed", "value", "threshold", "interval")
PLAN_KEYS = ("index", "condition", "role", "prompt")
# Database episode column -> where the archive record holds the same value: the stored,
# audited fields of the episode record's one home (core/record.py).
EPISODE_FIELDS: dict[str, tuple[str, ...]] = dict(AUDITED)
# Columns a revision added without filling them in for the rows already stored (NULL there, a value
# in the archived record): compared only where the row holds a value.
NULL_BEFORE_COLUMN = frozenset({"energy_j"})  # migrations/versions/0006_reexecute_energy.py


def detail_key(verdict: dict) -> str:
    """Where AuditReport.details keeps a verdict's detail."""
    return f"{verdict['gate']}|{verdict['condition']}|{verdict.get('phase', 'all')}"


@dataclass(frozen=True)
class AuditReport:
    """record: audit_version, archive_sha256, protocol_sha256, complete, planned, episodes,
    verdicts, problems, result ("agree" only when complete and without problems)."""

    record: dict
    unreadable: bool = False  # the file is not a zip packbench can open (the CLI exits 2)
    # Incomplete, and every problem says only that: a prefix of the plan whose every member
    # checks (a failed or interrupted attempt's archive). Not in the record: digests stay as they were.
    partial: bool = False
    # Every problem says only that the archive is incomplete, or that an archived episode (or a
    # sealed archive's verdicts, none stored) has no row yet (an attempt whose driver stopped in a
    # database outage or was killed: `db reconcile` inserts the rows). Only an unfinished
    # attempt's audit reads it (service/audit.py): a done attempt lacking rows disagrees.
    rows_pending: bool = False
    # The recomputed verdicts' details, "gate|condition|phase" -> detail: what the terminal table shows
    # beside the record (which way a fidelity bound compares, why a verdict failed). Not in the record:
    # digests stay as they were.
    details: dict = field(default_factory=dict)
    # Condition name -> tier (exact or approximate) from the archive's protocol: the terminal table
    # labels each verdict's tier, as every other verdict table does. Not in the record either.
    tiers: dict = field(default_factory=dict)

    @property
    def agrees(self) -> bool:
        return self.record["result"] == "agree"

    @property
    def complete(self) -> bool:
        return self.record["complete"]

    @property
    def digest(self) -> str:
        return canonical_sha256(self.record)

    @property
    def problems(self) -> list[str]:
        return self.record["problems"]


# ----------------------------------------------------------------------------- comparisons


def _key(v: dict) -> tuple:
    return (str(v.get("gate")), str(v.get("condition")), str(v.get("phase")))


def _norm(value: Any) -> Any:
    """Stored values as comparable plain data: tuples as lists (a database interval)."""
    return list(value) if isinstance(value, tuple) else value


# Verdict detail wordings earlier packbench wrote, as today's gates word them: the detail is
# compared exactly after this one rewrite (packbench 0.1's acquisition said "prompts" where the
# pairing by (repetition, prompt) now says "pairs"; tests/data/*-v1.zip hold it).
_OLD_DETAIL = re.compile(r"^(\d+ B / \d+ B over \d+) prompts( vs [A-Za-z0-9._-]+)$")


def _detail(stored: Any) -> Any:
    return _OLD_DETAIL.sub(r"\1 pairs\2", stored) if isinstance(stored, str) else stored


def _compare_verdicts(mine: list[dict], theirs: Any, where: str) -> list[str]:
    """Differences between recomputed verdicts and stored ones, one line each. `episodes` is
    compared when the stored verdicts carry it (the archive's do)."""
    if not isinstance(theirs, list) or not all(isinstance(v, dict) for v in theirs):
        return [f"{where} verdicts are not a list of verdicts"]
    a = {_key(v): v for v in mine}
    b: dict[tuple, dict] = {}
    out = []
    for v in theirs:
        if _key(v) in b:
            out.append(f"{where} has verdict {'/'.join(_key(v))} twice")
        b[_key(v)] = v
    out += [f"{where} lacks verdict {'/'.join(k)}" for k in sorted(set(a) - set(b))]
    out += [f"{where} has an extra verdict {'/'.join(k)}" for k in sorted(set(b) - set(a))]
    for k in sorted(set(a) & set(b)):
        keys = VERDICT_KEYS + tuple(f for f in ("episodes", "detail") if f in b[k] and f in a[k])
        diff = [f for f in keys if _norm(a[k].get(f)) != (_detail if f == "detail" else _norm)(b[k].get(f)) or
                type(a[k].get(f)) is bool and type(b[k].get(f)) is not bool]
        if diff:
            out.append(f"{where} verdict {'/'.join(k)} differs in {', '.join(diff)}: "
                       f"recomputed {[a[k].get(f) for f in diff]} vs stored {[_norm(b[k].get(f)) for f in diff]}")
    return out


def _at(record: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record


def _compare_episodes(episodes: list[dict], rows: Any) -> list[str]:
    """Database episode rows against the archive's records; a column the rows lack is skipped."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return ["database episodes are not a list of rows"]
    stored = {r.get("plan_index"): r for r in rows}
    out = []
    for e in episodes:
        i = e["plan_index"]
        row = stored.get(i)
        if row is None:
            out.append(f"database lacks episode {i}")
            continue
        for column, path in EPISODE_FIELDS.items():
            # A value the record lacks is stored as its field's default (core/record.py
            # stored_values): None for a nullable one. Before, a lacking value skipped the
            # comparison, so a row with a peak memory or fidelity the archive never held agreed.
            mine = _at(e, path)
            if FIELDS_BY_NAME[column].stored_as == "length":
                mine = token_count(mine)  # n_tokens: the ids the tokens hold, every sequence's
            elif mine is None:
                mine = FIELDS_BY_NAME[column].default
            if column in NULL_BEFORE_COLUMN and row.get(column) is None:
                continue
            if column in row and _norm(row[column]) != mine:
                out.append(f"database episode {i} {column} {row[column]!r} != archive {mine!r}")
    for i in sorted(set(stored) - {e["plan_index"] for e in episodes}, key=repr):
        out.append(f"database has episode {i} that the archive lacks")
    return out


# ----------------------------------------------------------------------------- one episode


def _int8_row_bytes(protocol: Protocol) -> int | None:
    """The bytes one int8 row moves (hidden int8 values and a scale) where the shape is known."""
    synth = protocol.model.synth
    return SHAPES[synth.shape]["hidden"] + INT8_SCALE_BYTES if synth is not None and synth.shape in SHAPES else None


# An episode's replay disagreements shown (the first ones: one is enough to disagree).
REPLAY_PROBLEMS_SHOWN = 5
_COUNTED_KEYS = ("hits", "misses", "prefetched", "used", "wasted")


def replay_problems(trace: Any, rec: dict, policy: str, params: dict) -> list[str]:
    """An exact episode's archived trace replayed through the simulator's ledger
    (core/simulate.py, whose bytes are core/charges.py's, the engine's one formula): per call and
    layer the record's ledger fields equal the replay's; for an expert cache or forecast, its
    counted hits, misses, prefetched, used and wasted experts, its routing and forecast sets equal
    the trace's and the replay's, and its figures (Belady's included) equal those recomputed from
    the trace's own sets. Each problem names the call, the layer and the field. Empty when the
    simulator has no entry for the policy on this unit (nothing to replay)."""
    from packbench.core import simulate as sim
    from packbench.core.expert_cache import FIGURE_KEYS, episode_figures
    from packbench.core.trace import forecast_possible

    m = trace.model
    if (m.unit, policy) not in sim.SIMULATED:
        return []
    if len({c.episode for c in trace.calls}) > 1:
        return ["the trace holds more than one episode"]
    try:
        replay = sim.ledger(trace, policy, params)
    except ValueError as e:  # SimulateError, a capacity the cache refuses
        return [f"cannot replay {policy} on its trace: {one_line(str(e))[:200]}"]
    out: list[str] = []
    calls = rec.get("calls")
    for c, (call, r) in enumerate(zip(calls, replay)):
        for key in sim.LEDGER_KEYS:
            got, want = call.get(key), r[key]
            if got == want:
                continue
            if not isinstance(got, list) or len(got) != len(want):
                out.append(f"call {c} {key}: recorded {one_line(repr(got))[:80]}, the trace's replay {want!r}")
                continue
            layer = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            out.append(f"call {c} layer {layer} {key}: recorded {got[layer]!r}, the trace's replay {want[layer]!r}")
    if policy not in sim.EXPERT_CACHES:
        return out
    experts = rec.get("experts")
    if not isinstance(experts, dict):
        return out + ["an expert cache's record has no experts section"]
    forecasting = sim.needs_forecast(policy, params)
    try:
        counted, routes = experts["counted"], experts["routes"]
        if len(counted) != len(replay) or len(routes) != len(replay):
            return out + [f"experts holds {len(counted)} calls' counts and {len(routes)} calls' routing, "
                          f"the trace {len(replay)} calls"]
        skip = set(m.layers_without_units)
        for c, (per_layer, routed, r) in enumerate(zip(counted, routes, replay)):
            if len(per_layer) != m.layers or len(routed) != m.layers:
                out.append(f"call {c} experts: {len(per_layer)} layers counted, the trace has {m.layers}")
                continue
            for layer in range(m.layers):
                n = per_layer[layer]
                if layer in skip:
                    if n is not None or routed[layer] is not None:
                        out.append(f"call {c} layer {layer}: experts counted in a layer without experts")
                    continue
                where = f"call {c} layer {layer}"
                if routed[layer] != trace.sets[c][layer].tolist():
                    out.append(f"{where} routing: recorded {routed[layer]!r}, the trace's active set "
                               f"{trace.sets[c][layer].tolist()!r}")
                wasted = r["rows_wasted"][layer] if r["prefetched"][layer] is not None else None
                want = {"hits": r["hits"][layer], "misses": r["misses"][layer],
                        "prefetched": r["prefetched"][layer], "used": r["used"][layer], "wasted": wasted}
                for key in _COUNTED_KEYS:
                    if n.get(key) != want[key]:
                        out.append(f"{where} {key}: recorded {n.get(key)!r}, the trace's replay {want[key]!r}")
                made = forecasting and trace.forecasts is not None and forecast_possible(m, layer, trace.version)
                want_forecast = trace.forecasts[c][layer].tolist() if made else None
                if n.get("forecast") != want_forecast:
                    out.append(f"{where} forecast: recorded {n.get('forecast')!r}, the trace's forecast set "
                               f"{want_forecast!r}")
    except (KeyError, TypeError, AttributeError) as e:
        return out + [f"experts section unreadable against its trace ({type(e).__name__}: {e})"]
    # The figures (Belady's among them) recomputed from the trace's own sets, not the record's routing.
    skip = set(m.layers_without_units)
    t_routes = [[None if layer in skip else s.tolist() for layer, s in enumerate(row)] for row in trace.sets]
    t_forecasts = None
    if forecasting and trace.forecasts is not None:
        t_forecasts = [[f.tolist() if forecast_possible(m, layer, trace.version) else None
                        for layer, f in enumerate(row)]
                       for row in trace.forecasts]
    figures = episode_figures(t_routes, [c.phase for c in trace.calls], capacity=params.get("capacity", 0),
                              rule=params.get("rule", "lru"), forecasts=t_forecasts)
    for key in FIGURE_KEYS:
        if experts.get(key) != figures[key]:
            out.append(f"experts {key}: recorded {one_line(repr(experts.get(key)))[:120]}, "
                       f"recomputed from the trace {one_line(repr(figures[key]))[:120]}")
    return out


def _traced(protocol: Protocol, condition: Any) -> bool:
    """Whether a traced protocol's exact episode of `condition` has a trace to check: the worker
    traces packbench's own loaders, whose model is the CPU-first one, never a competitor's own
    model (`accelerate`, `zero-inference`: engine/worker.py). A condition the protocol does not
    name is checked (other problems name it)."""
    return (condition not in protocol.condition_names
            or kind_of(protocol.condition(condition).policy).competitor is None)


def readback_problems(calls: list[dict], logits: Any, batch: int) -> list[str]:
    """Every call read back its sequences' last-position float32 logits, and only those: its
    `logits_d2h_bytes` is batch x vocab x 4, vocab the stored logits' last axis (the engine
    writes `logits.numel() * 4` per call, engine/episode.py and engine/flexgen.py; every archive
    since packbench 0.1 holds that). Empty where the logits' shape is not known: the token check
    names that."""
    if not isinstance(logits, np.ndarray) or logits.ndim < 2 or logits.shape[-1] < 1:
        return []
    want = batch * int(logits.shape[-1]) * 4
    bad = [(k, c["logits_d2h_bytes"]) for k, c in enumerate(calls) if c["logits_d2h_bytes"] != want]
    if not bad:
        return []
    k, got = bad[0]
    more = f" ({len(bad)} calls differ)" if len(bad) > 1 else ""
    return [f"call {k} logits_d2h_bytes {got} is not the {want} of its stored logits "
            f"({batch} x {logits.shape[-1]} vocab x 4 bytes){more}"]


def _episode_problems(name: str, rec: dict, logits: np.ndarray | None, protocol: Protocol,
                      row_bytes: list[int | None]) -> list[str]:
    """Recompute a finished episode's totals and tokens from its ledger and logits, and check
    what is physically possible: its wall time covers its calls; every layer moved exactly
    rows_copied x row bytes (`row_bytes[0]`: the model's, or fixed by the first row seen;
    `row_bytes[1]` the same for int8 rows)."""
    calls = rec.get("calls")
    bad = ledger_problems(calls)
    if bad:
        return [f"{name}: malformed call ledger: {'; '.join(bad[:3])}"]
    totals = episode_totals(calls)
    out = [f"{name}: {p}" for p in stored_total_problems(rec, totals)]
    out += [f"{name}: {p}" for p in wall_problems(rec, totals)]
    out += [f"{name}: {p}" for p in pass_problems(rec, separate=protocol.separate_passes)]  # schema 7's two passes
    if "experts" in rec:  # an expert cache or forecast: its figures replayed from its routing and ledger
        out += [f"{name}: {p}" for p in figure_problems(rec["experts"], calls)]
    # An int8 condition's rows are hidden int8 values plus a scale: its own row size (slot 1).
    cond = rec.get("condition")
    slot = int(cond in protocol.condition_names and weights_of(protocol.condition(cond).policy,
                                                               protocol.condition(cond).params) == "int8")
    moved, row_bytes[slot] = row_bytes_problems(calls, row_bytes[slot])
    out += [f"{name}: impossible copy: {p}" for p in moved]
    out += [f"{name}: {p}" for p in readback_problems(calls, logits, protocol.batch)]
    n, prefix, b = protocol.continuation_tokens, protocol.prefix_tokens, protocol.batch
    shape = [(c["phase"], c["tokens"]) for c in calls]
    if shape != [("prefill", b * prefix)] + [("decode", b)] * (n - 1):
        per = "" if b == 1 else f" of a batch of {b} (tokens count every sequence's)"
        out.append(f"{name}: calls are not one {prefix}-token prefill then {n - 1} one-token decode calls{per}")
    if b == 1:
        return out + _token_problems(name, rec.get("tokens"), logits, len(calls))
    tokens = rec.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != b:
        return out + [f"{name}: tokens are not {b} lists, one per sequence of the batch"]
    if logits is None or logits.ndim != 3 or logits.shape[0] != b:
        return out + [f"{name}: logits are not {b} sequences' (batch, calls, vocab)"]
    for s, (seq_tokens, seq_logits) in enumerate(zip(tokens, logits)):
        out += _token_problems(f"{name} sequence {s}", seq_tokens, seq_logits, len(calls))
    return out


def _token_problems(name: str, tokens: Any, logits: np.ndarray | None, calls: int) -> list[str]:
    """One sequence's tokens: one per call, the argmax of its (calls, vocab) logits."""
    if not isinstance(tokens, list) or len(tokens) != calls:
        return [f"{name}: tokens do not cover every call"]
    if (logits is None or logits.ndim != 2 or logits.shape[0] != calls or logits.shape[1] < 1
            or logits.dtype.kind != "f"):
        return [f"{name}: logits do not cover every call"]
    if not all(type(t) is int for t in tokens):
        return [f"{name}: tokens are not all integers"]
    if [int(t) for t in logits.argmax(axis=1)] != tokens:
        return [f"{name}: tokens are not the argmax of the stored logits"]
    return []


# Record fields the gates (core/gates.py) and the database comparison (EPISODE_FIELDS) read.
RETAINED = ("plan_index", "condition", "role", "prompt", "status", "error", "tokens", "wall_s", "call_s",
            "first_logit_since_entry_s", "h2d_weight_bytes", "h2d_index_bytes", "d2h_bytes", "tier", "forced_from",
            "energy_j")
_DROPPED = "<dropped: not a small scalar>"


def _small(v: Any) -> Any:
    if v is None or type(v) in (bool, int, float) or (type(v) is str and len(v) <= 1024):
        return v
    return _DROPPED


def _kept_tokens(tokens: Any) -> Any:
    """A record's tokens, bounded: a list of at most MAX_CONTINUATION + 1 ids, or a batch's list
    of at most MAX_BATCH + 1 such lists."""
    if not isinstance(tokens, list):
        return _small(tokens)
    if tokens and all(isinstance(t, list) for t in tokens):
        return [[_small(x) for x in t[:MAX_CONTINUATION + 1]] for t in tokens[:MAX_BATCH + 1]]
    return [_small(t) for t in tokens[:MAX_CONTINUATION + 1]]


def _retained(rec: dict) -> dict:
    """The part of an episode record an audit keeps after checking it: the RETAINED scalars,
    tokens (a list of at most MAX_CONTINUATION + 1), memory's scalars, phases' scalars."""
    out = {k: _small(rec[k]) for k in RETAINED if k in rec and k != "tokens"}
    tokens = rec.get("tokens")
    if "tokens" in rec:
        out["tokens"] = _kept_tokens(tokens)
    if isinstance(rec.get("memory"), dict):
        out["memory"] = {k: _small(v) for k, v in list(rec["memory"].items())[:64]}
    phases = rec.get("phases")
    if isinstance(phases, dict):
        out["phases"] = {ph: ({k: _small(v) for k, v in list(agg.items())[:64]} if isinstance(agg, dict)
                              else _small(agg)) for ph, agg in phases.items() if ph in ("prefill", "decode")}
    elif "phases" in rec:
        out["phases"] = _small(phases)
    if isinstance(rec.get("fidelity"), dict):
        out["fidelity"] = {k: _small(v) for k, v in list(rec["fidelity"].items())[:16]}
    elif "fidelity" in rec:
        out["fidelity"] = _small(rec["fidelity"])
    return out


# ----------------------------------------------------------------------------- the audit


class _Audit:
    """One audit's state; `run` fills `record`."""

    def __init__(self, path: Path, sha: str | None):
        self.path = path
        self.unreadable = False
        self.problems: list[str] = []
        self.incomplete_notes = 0  # problems that say only "incomplete" (AuditReport.partial)
        self.rows_lacking = 0  # problems that say only that an archived episode has no row (AuditReport.rows_pending)
        self.complete = False  # the archive is sealed (set by run)
        self.names: set[str] = set()  # every member name the zip holds (set by run)
        self.readable: set[str] = set()  # ... less those a verify() problem names: the trusted ones
        self.record: dict[str, Any] = {
            "audit_version": AUDIT_VERSION, "archive_sha256": sha, "protocol_sha256": None, "complete": False,
            "planned": 0, "episodes": 0, "verdicts": [], "problems": self.problems, "result": "disagree"}

    def scrub(self, message: str) -> str:
        """Messages name no path: the digest must not depend on where the archive lies."""
        for p in {str(self.path), str(self.path.resolve())}:
            message = message.replace(p, "the archive")
        return message

    def add(self, message: str) -> None:
        self.problems.append(self.scrub(message))

    def check_active_sets(self, reader: ArchiveReader, name: str, rec: dict, proto: Protocol) -> None:
        """A traced protocol's episode: its trace file (docs/traces.md) is there, reads under the
        trace format's bounds, and has the record's calls (phase and tokens) and, where the ledger
        observed activity, as many active units per layer as the ledger counted; then the trace
        replayed through the simulator (`replay_problems`) equals the record."""
        from packbench.core.trace import TraceError, parse_trace

        if name not in self.readable:
            if self.complete or name in self.names:
                self.add(f"{name}: the protocol says trace: true, the episode's trace is missing or unreadable")
            return
        try:
            with zipfile.ZipFile(io.BytesIO(reader.read_bytes(name))) as zf:
                t = parse_trace(zf, cap=ACTIVE_SETS_CAP)
        except (ArchiveError, TraceError, zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, OSError) as e:
            self.add(f"{name} is not a readable trace: {one_line(str(e))[:200]}")
            return
        calls = rec.get("calls")
        if not isinstance(calls, list) or len(calls) != len(t.calls):
            self.add(f"{name} holds {len(t.calls)} calls, the record {len(calls) if isinstance(calls, list) else 'none'}")
            return
        for c, (call, traced) in enumerate(zip(calls, t.calls)):
            if not isinstance(call, dict) or call.get("phase") != traced.phase or call.get("tokens") != traced.tokens:
                self.add(f"{name}: call {c}'s phase or tokens differ from the record's")
                return
            active = call.get("active_rows")
            sizes = [s.size for s in t.sets[c]]
            if isinstance(active, list) and any(a is not None and a != n for a, n in zip(active, sizes)):
                self.add(f"{name}: call {c}'s active sets differ in size from the ledger's active_rows")
                return
        cond = rec.get("condition")
        if cond in proto.condition_names:
            c = proto.condition(cond)
            for p in replay_problems(t, rec, c.policy, c.resolved_params)[:REPLAY_PROBLEMS_SHOWN]:
                self.add(f"{name}: {p}")

    def read(self, reader: ArchiveReader, name: str, kind: str, **checks: Any) -> Any:
        try:
            return reader.read_array(name, **checks) if kind == "array" else reader.read_json(name)
        except ArchiveError as e:
            self.add(f"cannot read {name}: {e}")
            return None

    def run(self, reader: ArchiveReader, *, db_verdicts: list[dict] | None, db_episodes: list[dict] | None) -> None:
        """The audit of an open archive, step by step: its members (verify), its protocol, its
        plan and worker records, each planned episode, then the verdicts recomputed from them."""
        self.complete = reader.complete
        self.record["complete"] = self.complete
        found = reader.verify()
        for p in found:
            self.add(p.message)
            self.incomplete_notes += p.kind == "incomplete"
        if any(p.kind == "too-large" for p in found):
            return  # over the bounds: nothing is recomputed (the bounds exist to cap this work)
        self.names = set(reader.names)
        # A member that verify() names is not trusted for recomputation; no other is.
        self.readable = self.names - {p.member for p in found}
        proto = self.protocol(reader)
        if proto is None:
            return
        entries = make_plan(proto)
        self.record["planned"] = len(entries)
        stored_plan = self.read(reader, PLAN_NAME, "json") if PLAN_NAME in self.readable else None
        if stored_plan is None and (self.complete or PLAN_NAME in self.names):
            self.add(f"{PLAN_NAME} is missing or unreadable")
        elif stored_plan is not None:
            self.check_plan(stored_plan, entries, proto)
        worker = self.read(reader, WORKER_NAME, "json") if WORKER_NAME in self.readable else None
        if worker is None and (self.complete or WORKER_NAME in self.names):
            # The driver writes worker.json before the first episode: a sealed archive without it
            # lost the start record every check of the environment and start bytes reads.
            self.add(f"{WORKER_NAME} is missing or unreadable")
        start = worker_parts(worker).get("start")
        self.check_records(reader, worker, proto, entries)
        row_bytes: list[int | None] = [self.check_start(start, proto), _int8_row_bytes(proto)]

        episodes, recorded, vocab = [], [], None
        for entry in entries:
            episode = self.episode(reader, entry, proto, start, row_bytes)
            if episode is None:
                continue
            recorded.append(entry["index"])
            episodes.append(episode)
            logits = episode["logits"]
            if episode.get("status") == "ok" and logits is not None and logits.ndim in (2, 3) and vocab is None:
                vocab = int(logits.shape[-1])
        self.check_fidelity(episodes, proto)
        self.record["episodes"] = len(episodes)
        if not self.complete:
            self.note_incomplete(recorded, len(entries))
        if stored_plan is not None and vocab is not None:
            self.check_prompts(stored_plan, proto, vocab)
        self.judge(reader, proto, episodes, start, db_verdicts=db_verdicts, db_episodes=db_episodes)

    def protocol(self, reader: ArchiveReader) -> Protocol | None:
        """protocol.json as a typed protocol, checked to be in frozen form and to be the one the
        manifest names; None when there is nothing to recompute against."""
        if PROTOCOL_NAME not in self.readable:
            if self.complete or PROTOCOL_NAME in self.names:
                self.add(f"cannot recompute: no readable {PROTOCOL_NAME}")
            return None
        body = self.read(reader, PROTOCOL_NAME, "json")
        if body is None:
            return None
        try:
            proto = expand(body)  # validated once; everything below reads the typed protocol
            if canonical_json(proto.body_dict()) != canonical_json(body):
                self.add("protocol.json is not in frozen form (it does not re-validate to itself)")
        except ProtocolError as e:
            self.add(f"cannot recompute: protocol.json is not a valid frozen protocol: {e}")
            return None
        self.record["protocol_sha256"] = canonical_sha256(body)
        if reader.manifest is not None and reader.manifest.get("protocol_sha256") != self.record["protocol_sha256"]:
            self.add("manifest protocol_sha256 does not match protocol.json")
        return proto

    def episode(self, reader: ArchiveReader, entry: dict, proto: Protocol, start: Any,
                row_bytes: list[int | None]) -> dict | None:
        """Planned episode `entry`'s members, checked against its plan entry, its ledger, its
        logits, trace and start record; what the gates need of it (None: not recorded)."""
        i = entry["index"]
        members = episode_members(i)
        name, logits_name, trace_name = members.record, members.logits, members.trace
        forced_name = members.forced
        if name not in self.readable:
            if self.complete or name in self.names:
                self.add(f"episode {i} has no readable record ({name})")
            return None
        rec = self.read(reader, name, "json")
        if not isinstance(rec, dict):
            if rec is not None:
                self.add(f"{name} is not a record")
            return None
        # Same value and same JSON type (true is not 1, 1.0 is not 1).
        if (type(rec.get("plan_index")) is not int or rec.get("plan_index") != i
                or any(type(rec.get(k)) is not type(entry[k]) or rec.get(k) != entry[k] for k in PLAN_KEYS[1:])
                or rec.get("prompts") != entry.get("prompts")):
            self.add(f"{name} does not match plan entry {i}")
        ndim = 2 if proto.batch == 1 else 3  # (calls, vocab), a batch's (sequences, calls, vocab)
        logits = (self.read(reader, logits_name, "array", dtype=LOGITS_DTYPE, ndim=ndim)
                  if logits_name in self.readable else None)
        ok = rec.get("status") == "ok"
        if ok and logits is None and not self.complete and logits_name not in self.names:
            return None  # interrupted between the record and its logits: not recorded yet
        if ok:
            self.check_sampled(name, trace_name, rec, self.names)
        if ok and trace_name in self.readable:
            self.check_trace(trace_name, self.read(reader, trace_name, "array", dtype=TRACE_DTYPE, ndim=2), rec)
        if ok and proto.traced and rec.get("tier") == "exact" and _traced(proto, rec.get("condition")):
            self.check_active_sets(reader, members.active, rec, proto)
        if ok:
            self.check_memory(name, rec, start)
            self.check_condition(name, rec, proto, start)
            for p in _episode_problems(name, rec, logits, proto, row_bytes):
                self.add(p)
        elif rec.get("status") != "failed":
            self.add(f"{name}: status {rec.get('status')!r} is neither ok nor failed")
        # Only what the gates and the database comparison read is kept (the ledger is
        # checked above): audit memory holds one record's JSON, not the archive's, whatever
        # a hostile record carries besides.
        forced = (self.read(reader, forced_name, "array", dtype=LOGITS_DTYPE, ndim=ndim)
                  if forced_name in self.readable else None)
        if forced is not None and rec.get("tier") != "approximate":
            self.add(f"{forced_name}: teacher-forced logits of an episode that is not approximate")
        return {**_retained(rec), "plan_index": i, "logits": logits, "forced_logits": forced}

    def check_condition(self, name: str, rec: dict, proto: Protocol, start: Any) -> None:
        """A finished episode's record says the condition it ran as the protocol froze it (its
        `policy` and `params`, where the record holds them: archives of packbench 0.1 lack params),
        and a competitor's configuration is what its kind would have written (its kind's
        `record_problems`: zero-inference's DeepSpeed configuration, flexgen's placement policy)."""
        cond = rec.get("condition")
        if cond not in proto.condition_names:
            return  # the plan-entry check names it
        c = proto.condition(cond)
        for key, want in (("policy", c.policy), ("params", dict(c.params))):
            if key in rec and rec[key] != want:
                self.add(f"{name}: {key} {one_line(repr(rec[key]))[:120]} is not its condition's ({want!r})")
        competitor = kind_of(c.policy).competitor
        if competitor is None:
            return
        synth = proto.model.synth
        config = shape_config(synth.shape) if synth is not None and synth.shape in SHAPES else None
        if synth is not None and is_moe_shape(synth.shape):
            config = moe_config(synth.shape, layers=synth.layers, dtype=proto.dtype)
        device = start.get("device") if isinstance(start, dict) else None
        ctx = RecordContext(allowance_bytes=proto.allowance_bytes, dtype=proto.dtype, batch=proto.batch,
                            capacity=proto.prefix_tokens + proto.continuation_tokens,
                            cuda=isinstance(device, str) and device.startswith("cuda"), config=config)
        for p in competitor.record_problems(c.params, rec, ctx):
            self.add(f"{name}: {p}")

    def judge(self, reader: ArchiveReader, proto: Protocol, episodes: list[dict], start: Any, *,
              db_verdicts: list[dict] | None, db_episodes: list[dict] | None) -> None:
        """The verdicts recomputed from the episodes, against verdicts.json and the database's;
        the database's episodes against the archive's."""
        verdicts = compute_verdicts(proto, episodes, start=start)
        self.record["verdicts"] = [{k: v[k] for k in VERDICT_KEYS + ("episodes",)} for v in verdicts]
        self.details = {detail_key(v): v["detail"] for v in verdicts if v.get("detail")}
        self.tiers = {c.name: c.tier for c in proto.conditions}
        if not self.complete:
            # docs/archive.md: verdicts of a partial screen fail closed; the ones computed from
            # the episodes present are compared below, never reported as passing.
            self.record["verdicts"] = [{**v, "passed": False} for v in self.record["verdicts"]]
        if VERDICTS_NAME in self.readable:
            stored = self.read(reader, VERDICTS_NAME, "json")
            if stored is not None:
                self.problems += [self.scrub(p) for p in _compare_verdicts(verdicts, stored, "archive")]
        elif self.complete and VERDICTS_NAME not in self.names:
            self.add(f"{VERDICTS_NAME} is missing")
        if db_verdicts is not None and (self.complete or db_verdicts):
            found = _compare_verdicts(verdicts, db_verdicts, "database")
            if not db_verdicts:
                # None stored for a sealed archive: its driver stopped between the seal and the
                # verdicts' one transaction (killed, or a database outage). Rows pending, like an
                # archived episode's: `db reconcile` inserts them from the archive.
                self.rows_lacking += len(found)
            self.problems += found
        if db_episodes is not None:
            found = _compare_episodes(episodes, db_episodes)
            self.rows_lacking += sum(p.startswith("database lacks episode ") for p in found)
            self.problems += found

    def check_records(self, reader: ArchiveReader, worker: Any, proto: Protocol, entries: list[dict]) -> None:
        """Cross-checks between records: the manifest's environment and source freeze are
        worker.json's; every member belongs to the layout of this plan."""
        manifest = reader.manifest
        parts = worker_parts(worker)
        if manifest is not None:
            if "environment" in parts and manifest.get("environment") != parts["environment"]:
                self.add(f"the manifest's environment differs from {WORKER_NAME}'s")
            if "source_freeze" in parts and manifest.get("source_freeze") != parts["source_freeze"]:
                self.add(f"the manifest's source_freeze differs from {WORKER_NAME}'s")
        if manifest is not None and not isinstance(manifest.get("source_freeze", {}), dict):
            self.add("the manifest's source_freeze is not a mapping")
        allowed = set(FIXED_MEMBERS)
        for e in entries:
            m = episode_members(e["index"])
            allowed |= {m.record, m.logits, m.trace}
            if proto.traced and proto.tier(e["condition"]) == "exact":
                allowed.add(m.active)  # a competitor runs a model of its own: no trace
            if proto.tier(e["condition"]) == "approximate":
                allowed.add(m.forced)
        strays = [n for n in reader.names if n not in allowed]
        for n in strays[:10]:
            self.add(f"member {n!r} is not part of the archive of this plan")
        if len(strays) > 10:
            self.add(f"... and {len(strays) - 10} more members that are not part of the archive of this plan")

    def check_start(self, start: Any, proto: Protocol) -> int | None:
        """The start record's byte counts add up, and equal the synthetic model's shape; returns
        the bytes of one outgoing row when the shape is known (None otherwise)."""
        pinned = proto.model.sha256
        digest = start.get("model_sha256") if isinstance(start, dict) else None
        self.model_sha256 = digest  # what the database's attempt must say it measured
        # An attempt that stopped before worker.json (a worker refusing a checkpoint whose digest
        # differs from the pin does) measured nothing: its archive is incomplete, not a disagreement.
        measured = start is not None or self.complete or WORKER_NAME in self.names
        if pinned is not None and digest != pinned and measured:
            self.add(f"{WORKER_NAME}: the checkpoint measured has digest {digest!r}, the protocol pins {pinned}")
        if digest is not None and (not isinstance(digest, str) or re.fullmatch(r"[0-9a-f]{64}", digest) is None):
            self.add(f"{WORKER_NAME}: model_sha256 {digest!r} is not 64 lowercase hex digits")
        if not isinstance(start, dict):
            return None
        got = {k: start.get(k) for k in START_BYTES}
        ints = {k: v for k, v in got.items() if isinstance(v, int) and not isinstance(v, bool)}
        if len(ints) == 3 and ints["param_bytes"] != ints["device_param_bytes"] + ints["host_outgoing_bytes"]:
            self.add(f"{WORKER_NAME}: param_bytes {ints['param_bytes']} != device_param_bytes "
                     f"{ints['device_param_bytes']} + host_outgoing_bytes {ints['host_outgoing_bytes']}")
        synth = proto.model.synth
        if synth is None or synth.shape not in SHAPES:
            return None
        want = opt_bytes(**SHAPES[synth.shape], dtype=proto.dtype)  # held in the protocol's dtype
        for k, v in ints.items():
            if v != want[k]:
                self.add(f"{WORKER_NAME}: {k} {v} is not the {want[k]} of a {synth.shape} model in {proto.dtype}")
        return want["row_bytes"]

    def check_fidelity(self, episodes: list[dict], proto: Protocol) -> None:
        """Every approximate episode's fidelity figures, recomputed from the archived logits (its
        teacher-forced ones against the reference episode it names), equal what its record says;
        the tier each record states is its condition's."""
        by_index = {e["plan_index"]: e for e in episodes}
        for e in episodes:
            name = episode_members(e["plan_index"]).record
            tier = proto.tier(e["condition"]) if e.get("condition") in proto.condition_names else None
            if "tier" in e and e["tier"] != tier:
                self.add(f"{name}: tier {e['tier']!r} is not its condition's ({tier})")
            if tier != "approximate" or e.get("status") != "ok":
                if e.get("fidelity") is not None:
                    self.add(f"{name}: fidelity figures on an episode that is not a finished approximate one")
                continue
            try:
                recomputed = of_episode(e, by_index, reference=proto.reference).as_dict()
            except ValueError:
                recomputed = None
            if e.get("fidelity") != recomputed:
                self.add(f"{name}: fidelity {e.get('fidelity')!r} != {recomputed!r} recomputed from the logits")

    def check_memory(self, name: str, rec: dict, start: Any) -> None:
        memory = rec.get("memory")
        if not isinstance(memory, dict) or not isinstance(start, dict):
            return
        mine, theirs = memory.get("device_param_bytes"), start.get("device_param_bytes")
        if mine is not None and theirs is not None and mine != theirs:
            self.add(f"{name}: memory.device_param_bytes {mine!r} != {WORKER_NAME}'s {theirs!r}")

    def check_sampled(self, name: str, trace_name: str, rec: dict, names: set[str]) -> None:
        """A run that sampled memory keeps its trace: without it the sampled peak is unchecked."""
        memory = rec.get("memory") if isinstance(rec.get("memory"), dict) else {}
        sampler = rec.get("sampler") if isinstance(rec.get("sampler"), dict) else {}
        samples = sampler.get("samples")
        sampled = memory.get("peak_sampled_bytes") is not None or (isinstance(samples, int) and samples > 0)
        if sampled and trace_name not in names:
            self.add(f"{name}: the run sampled memory but {trace_name} is missing")

    def check_trace(self, name: str, trace: Any, rec: dict) -> None:
        """The sampled peak a record states must be the largest sample of its memory trace."""
        if trace is None:
            return
        memory = rec.get("memory") if isinstance(rec.get("memory"), dict) else {}
        stated = memory.get("peak_sampled_bytes")
        if getattr(trace, "ndim", 0) != 2 or trace.shape[1:] != (2,):
            self.add(f"{name}: a memory trace is (samples, 2) [seconds, bytes]")
        elif trace.shape[0] == 0:
            if stated is not None:
                self.add(f"{name}: empty trace but peak_sampled_bytes {stated!r}")
        elif not np.isfinite(trace).all():
            self.add(f"{name}: the memory trace holds non-finite values")
        elif stated != int(trace[:, 1].max()):
            self.add(f"{name}: peak_sampled_bytes {stated!r} != {int(trace[:, 1].max())} recomputed from the trace")

    def check_plan(self, stored: Any, entries: list[dict], proto: Protocol) -> None:
        got = plan_entries(stored)
        if got is None:
            self.add("plan.json has no list of entries")
            return
        # A batch entry's prompts too (core/plan.py); batch-1 entries have none on either side.
        want = [[e[k] for k in PLAN_KEYS] + [e.get("prompts")] for e in entries]
        have = [[e.get(k) for k in PLAN_KEYS] + [e.get("prompts")] for e in got]
        if have != want:
            first = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
            self.add(f"plan.json is not the plan of protocol.json (first difference at entry {first}; "
                     f"{len(have)} entries, the protocol plans {len(want)})")
        ids = plan_prompts(stored)
        n = proto.prefix_tokens
        if (not isinstance(ids, list) or len(ids) != proto.prompt_count
                or not all(isinstance(p, list) and len(p) == n for p in ids)):
            self.add(f"plan.json prompts are not {proto.prompt_count} prompts of {n} token ids")

    def check_prompts(self, stored: dict, proto: Protocol, vocab: int) -> None:
        if proto.prompts.source not in ("generator", "token_ids"):
            return  # file prompts: the file is not in the archive; its SHA-256 is frozen in the protocol
        ids = plan_prompts(stored)
        if not isinstance(ids, list) or len(ids) != proto.prompt_count:
            return  # already reported by check_plan; recomputing needs no more than what is stored
        try:
            want = make_prompts(proto, vocab=vocab)
        except (ValueError, ProtocolError) as e:
            self.add(f"cannot recompute the prompts: {e}")
            return
        if ids != want:
            self.add("plan.json prompts are not the protocol's prompts")

    def note_incomplete(self, recorded: list[int], planned: int) -> None:
        self.incomplete_notes += 1  # the count below; a gap is a problem of its own
        if recorded != list(range(len(recorded))):
            gaps = sorted(set(range(max(recorded) + 1)) - set(recorded))
            self.add(f"archive incomplete and not a prefix of the plan: episodes {gaps[:10]} are missing "
                     f"before later ones")
        self.add(f"archive incomplete: {len(recorded)} of {planned} planned episodes recorded; "
                 f"verdicts from a partial screen are not the screen's")


def audit_archive(path: Path, *, expected_sha256: str | None = None, db_verdicts: list[dict] | None = None,
                  db_episodes: list[dict] | None = None, trust: list[bytes] | None = None,
                  signature: Path | None = None, max_mib: int | None = None,
                  target: str | None = None, expected_protocol_sha256: str | None = None,
                  expected_model_sha256: str | None = None) -> AuditReport:
    """Audit one archive. `expected_sha256`, `db_verdicts`, `db_episodes` and
    `expected_protocol_sha256` (the SHA-256 of the protocol the database's screen names) and
    `expected_model_sha256` (the checkpoint digest the database's attempt says it measured) come
    from the database when it is at hand; every one given must agree for the result to be "agree".

    `trust`: raw Ed25519 public keys (core.provenance). When given, the archive's detached
    signature (`signature`, default `<archive>.sig`) must be a valid one by one of them: the
    record then carries `signature: {status, key_id}`, and an unsigned, unknown-signer or
    bad-signature archive never agrees. Without `trust` provenance is not checked (and the
    record has no `signature` key, so digests of earlier audits hold).

    `max_mib` raises the archive-file and total-member bounds (docs/archive.md, "Bounds") for an
    archive known to be large and trusted; the stated audit time and memory then no longer hold.
    An archive over them is one problem line naming its size, the bound and the `packbench audit
    TARGET --max-mib N` that reads it (`target`: a screen id; default `archive PATH`); a file over
    the file bound is never hashed (record `archive_sha256` None), so no SHA-256 is compared.

    Cheap checks first: the file's size and zip end record are read before anything is hashed.
    Raises ArchiveError only when there is no file at `path`; everything wrong with the file
    itself, running out of memory included, is a problem line in the report.
    """
    path = Path(path)
    if not path.is_file():
        raise ArchiveError(f"no archive at {path}; check the path (or the attempt's archive_path in the database)")
    audit = _Audit(path, None)
    try:
        _run_audit(audit, path, expected_sha256=expected_sha256, db_verdicts=db_verdicts, db_episodes=db_episodes,
                   trust=trust, signature=signature, max_mib=max_mib, target=target,
                   expected_protocol_sha256=expected_protocol_sha256, expected_model_sha256=expected_model_sha256)
    except MemoryError:
        audit.add("out of memory while auditing: the archive needs more memory than this machine gave the audit "
                  "(docs/archive.md, Bounds)")
    except RecursionError:
        audit.add("the archive nests its records too deeply to audit")
    except Exception as e:  # hostile input reached a path no check foresaw: fail closed, one line
        audit.add(f"cannot audit: {type(e).__name__} while recomputing ({str(e).splitlines()[0][:200] if str(e) else ''}); "
                  f"the archive is hostile or damaged")
    record = audit.record
    partial = not record["complete"] and not audit.unreadable and len(audit.problems) == audit.incomplete_notes
    # A sealed archive's rows are pending only while the database never recorded its seal (no
    # SHA-256 stored): one whose seal it recorded had stored every row before, so a row it lacks
    # now was removed (a failed attempt, every episode failed, is sealed and recorded too).
    pending = (not audit.unreadable and audit.rows_lacking > 0 and (not record["complete"] or expected_sha256 is None)
               and len(audit.problems) == audit.incomplete_notes + audit.rows_lacking)
    record["problems"] = _bounded(record["problems"])
    record["result"] = "agree" if record["complete"] and not record["problems"] else "disagree"
    return AuditReport(record, unreadable=audit.unreadable, partial=partial, rows_pending=pending,
                       details=getattr(audit, "details", {}), tiers=getattr(audit, "tiers", {}))


MAX_PROBLEM_CHARS = 2000  # a problem is one readable line, whatever a hostile record holds
MAX_PROBLEMS = 1000


def _bounded(problems: list[str]) -> list[str]:
    """At most MAX_PROBLEMS lines of at most MAX_PROBLEM_CHARS characters each (the rest named)."""
    out = [p if len(p) <= MAX_PROBLEM_CHARS else f"{p[:MAX_PROBLEM_CHARS]}... ({len(p) - MAX_PROBLEM_CHARS} more "
           f"characters)" for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        out.append(f"... and {len(problems) - MAX_PROBLEMS} more problems")
    return out


def _run_audit(audit: _Audit, path: Path, *, expected_sha256: str | None, db_verdicts: list[dict] | None,
               db_episodes: list[dict] | None, trust: list[bytes] | None, signature: Path | None,
               max_mib: int | None = None, target: str | None = None,
               expected_protocol_sha256: str | None = None, expected_model_sha256: str | None = None) -> None:
    limits = {}
    if max_mib is not None:
        big = max(int(max_mib) << 20, archive_reader.MAX_ARCHIVE_BYTES)
        limits = {"max_archive_bytes": big, "max_total_bytes": big}
    try:
        reader = ArchiveReader(path, **limits)
    except ArchiveTooLarge as e:  # never hashed: there is no SHA-256 to compare, only the bound to name
        audit.unreadable = True
        # The archive's path is "the archive" in a record (its digest does not depend on where it lies),
        # so a file's audit names `archive FILE`; a screen's names its id.
        audit.problems.append(e.line(target or "archive FILE", path="the archive"))
        if trust is not None:
            audit.record["signature"] = {"status": "bad-signature", "key_id": None}
            audit.add("signature: the archive is over the size bound, so no signature can hold for it")
        return
    except ArchiveError as e:
        reader = None
        opened = str(e)
    audit.record["archive_sha256"] = file_sha256(path)  # within the file bound: hashed, zip or not
    if expected_sha256 is not None and audit.record["archive_sha256"] != expected_sha256:
        audit.add(f"archive SHA-256 {audit.record['archive_sha256']} differs from the database's {expected_sha256}")
    if reader is None:
        audit.unreadable = True
        audit.add(opened)
        if trust is not None:
            audit.record["signature"] = {"status": "bad-signature", "key_id": None}
            audit.add("signature: the archive is unreadable, so no signature can hold for it")
        return
    # verify's total-bound line names the command that reads the archive: as the file bound's line
    # above, never the scrubbed path ("archive the archive")
    reader.audit_target = target or "archive FILE"
    with reader:
        manifest_sha = None
        if trust is not None and reader.complete:
            try:
                manifest_sha = sha256_hex(reader.read_bytes(MANIFEST_NAME))
            except ArchiveError:
                manifest_sha = None
        audit.run(reader, db_verdicts=db_verdicts, db_episodes=db_episodes)
    archived = audit.record["protocol_sha256"]
    if expected_protocol_sha256 is not None and archived is not None and archived != expected_protocol_sha256:
        # Before, a screen whose database row named another protocol than the one its archive ran
        # audited AGREE: `results --protocol` and `compare --protocol` counted it under the wrong one.
        audit.add(f"the archive ran protocol {archived}; the database's screen names protocol "
                  f"{expected_protocol_sha256}")
    measured = getattr(audit, "model_sha256", None)
    if expected_model_sha256 is not None and audit.record["protocol_sha256"] is not None and measured != expected_model_sha256:
        # Before, an attempt whose database row named another checkpoint digest than its archive's
        # worker.json audited AGREE (`compare` warns on different weights from the rows).
        audit.add(f"{WORKER_NAME}: the checkpoint measured has digest {measured!r}; the database's attempt says "
                  f"{expected_model_sha256}")
    if trust is not None:
        check = check_signature(signature or signature_path(path), archive_sha256=audit.record["archive_sha256"],
                                manifest_sha256=manifest_sha, trusted=list(trust))
        audit.record["signature"] = {"status": check.status, "key_id": check.key_id}
        if check.line is not None:
            audit.add(check.line)
