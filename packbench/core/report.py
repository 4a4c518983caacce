"""The data of a screen report, read from its raw archive: pure Python + numpy.

`read_screen(path)` reads one archive (core.archive.ArchiveReader: protocol.json, plan.json,
worker.json, episodes/, traces/, verdicts.json, manifest.json) into a `ScreenData`; the other
functions derive every series the report plots from it. No database, no Ray, no plotting:
the command line (cli/report.py) adds the audits a database holds and draws the figures.

Every number comes from the archive's records (the raw evidence) or from the gate functions
run over them, never from the database's copies, so a report is what an auditor would see.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packbench.core.archive import (PROTOCOL_NAME, VERDICTS_NAME, WORKER_NAME, ArchiveReader, episode_member,
                          file_sha256, trace_member)
from packbench.core.dispersion import spread
from packbench.core.errors import ArchiveError
from packbench.core.gates import planned_episodes, runtime
from packbench.core.passes import overhead
from packbench.core.plan import plan
from packbench.core.protocol import MIB, Protocol, expand
from packbench.core.record import token_count
from packbench.core.registry import SHAPES
from packbench.core.serving import by_previous, condition_serving, episode_serving, position_check, robust_runtime, scored_ok

PHASES = ("prefill", "decode")
# The runtime interval shown for a condition without a declared runtime gate: the gate's own
# defaults (docs/protocol.md), against the protocol's reference.
DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES, DEFAULT_SEED = 0.95, 10000, 0


@dataclass(frozen=True)
class Episode:
    """One planned episode's record as archived (no logits), plus its plan `repetition` and
    its memory `trace` ((samples, 2): seconds, bytes; None when the archive has none)."""

    record: dict
    repetition: int | None
    trace: np.ndarray | None

    @property
    def index(self) -> int:
        return self.record["plan_index"]

    @property
    def condition(self) -> str:
        return self.record["condition"]

    @property
    def scored(self) -> bool:
        return self.record.get("role") == "scored"

    @property
    def ok(self) -> bool:
        return self.record.get("status") == "ok"

    @property
    def calls(self) -> list[dict]:
        calls = self.record.get("calls")
        return calls if isinstance(calls, list) else []


@dataclass(frozen=True)
class ScreenData:
    """What a report shows about one screen attempt, as its archive holds it."""

    path: Path
    archive_sha256: str  # of the whole file, what the database stores
    archive_bytes: int
    complete: bool
    problems: tuple[str, ...]  # ArchiveReader.verify(): [] for an intact archive
    protocol: Protocol
    manifest: dict  # {} for an archive without a manifest
    environment: dict
    start: dict
    model_dir: str | None
    planned: int
    verdicts: list[dict]
    episodes: list[Episode] = field(default_factory=list)

    @property
    def conditions(self) -> tuple[str, ...]:
        return self.protocol.condition_names

    @property
    def label(self) -> str:
        """`name#screen.attempt on host` when the manifest says so, else the file name."""
        m = self.manifest
        where = self.environment.get("gpu") or self.environment.get("device") or ""
        host = self.environment.get("host")
        if "screen_id" in m:  # "screen 7.1" read as a version number: the attempt is named
            text = f"{self.protocol.name} screen {m['screen_id']}, attempt {m.get('attempt', '?')}"
        else:
            text = f"{self.protocol.name} ({self.path.name})"
        return f"{text} on {host}{' ' + where if where else ''}" if host else text

    def of(self, condition: str, *, scored_only: bool = True, ok_only: bool = True) -> list[Episode]:
        return [e for e in self.episodes if e.condition == condition and (e.scored or not scored_only)
                and (e.ok or not ok_only)]


def failed_episodes(s: ScreenData) -> list[dict]:
    """Why episodes failed, as their records say: one row per (condition, error), in plan order of
    its first episode: {condition, error (its first non-blank line), episodes (plan indexes)}."""
    groups: dict[tuple[str, str], list[int]] = {}
    for e in s.episodes:
        if not e.ok:
            # The first non-blank line: an error text that starts with a newline showed an empty cell.
            error = next((line for line in str(e.record.get("error") or "").splitlines() if line.strip()),
                         "no error recorded")
            groups.setdefault((str(e.condition), error), []).append(e.index)
    return [{"condition": c, "error": error, "episodes": indexes} for (c, error), indexes in groups.items()]


def _verdicts(path: Path, value: Any) -> list[dict]:
    """verdicts.json as every page reads it: a list of objects, each with a text gate and
    condition. A consistent forgery (manifest recomputed) may hold anything there: ArchiveError,
    rather than a page that draws a verdict of condition None."""
    bad = (f"{type(value).__name__}, not a list of verdicts" if not isinstance(value, list) else
           next((f"verdict {n} without a text gate and condition" for n, v in enumerate(value)
                 if not (isinstance(v, dict) and isinstance(v.get("gate"), str)
                         and isinstance(v.get("condition"), str))), None))
    if bad is not None:
        raise ArchiveError(f"{path}: verdicts.json holds {bad}, which is not of the archive format; run "
                           f"`packbench audit archive {path}` to see what else differs")
    return value


def read_screen(path: Path | str, *, max_member_bytes: int = 1 << 30) -> ScreenData:
    """Read an archive into a ScreenData. Raises ArchiveError when it has no readable frozen
    protocol (nothing can be reported) or verdicts not of the archive format; anything less is
    kept in `problems` and shown."""
    path = Path(path)
    with ArchiveReader(path, max_member_bytes=max_member_bytes) as r:
        problems = tuple(str(p) for p in r.verify())
        names = set(r.names)
        try:
            protocol = expand(r.read_json(PROTOCOL_NAME))
        except (ArchiveError, ValueError) as e:
            raise ArchiveError(f"cannot report on {path}: no usable protocol.json ({e})") from None
        manifest = r.manifest or {}
        worker = r.read_json(WORKER_NAME) if WORKER_NAME in names else {}
        verdicts = _verdicts(path, r.read_json(VERDICTS_NAME)) if VERDICTS_NAME in names else []
        entries = plan(protocol)
        records = [r.read_json(episode_member(e["index"])) for e in entries if episode_member(e["index"]) in names]
        episodes = []
        for rec in planned_episodes(protocol, records):  # adds each record's repetition
            trace_name = trace_member(rec["plan_index"])
            trace = r.read_array(trace_name) if trace_name in names else None
            rep = rec.pop("repetition")
            episodes.append(Episode(record=rec, repetition=rep, trace=trace))
    return ScreenData(path=path, archive_sha256=file_sha256(path), archive_bytes=path.stat().st_size,
                      complete=bool(manifest), problems=problems, protocol=protocol, manifest=manifest,
                      environment=dict(manifest.get("environment") or worker.get("environment") or {}),
                      start=dict(worker.get("start") or {}), model_dir=worker.get("model_dir"),
                      planned=len(entries), verdicts=list(verdicts), episodes=episodes)


# ----------------------------------------------------------------------------- model facts


def model_label(screen: ScreenData) -> str:
    m = screen.protocol.model
    if m.synth is not None:
        s = m.synth
        if s.is_moe:
            return f"synthetic {s.shape} {s.dtype} ({s.layers} layers, routing {s.routing}, seed {s.seed})"
        if s.profile is not None:
            return f"synthetic {s.shape} {s.dtype} (profile {s.profile}, seed {s.seed})"
        hot = f", {s.hot_fraction:g} hot" if s.hot_fraction else ""
        return f"synthetic {s.shape} {s.dtype} (sparsity {s.sparsity:g}, seed {s.seed}{hot})"
    return f"checkpoint {m.path}"


def unit_name(screen: ScreenData) -> str:
    """What an active row of the screen's model is: "experts" (an MoE model: the synthetic
    shape's family, else the start record's `unit`), else "neurons" (OPT's FFN rows)."""
    synth = screen.protocol.model.synth
    if synth is not None:
        return "experts" if synth.is_moe else "neurons"
    return "experts" if screen.start.get("unit") == "expert" else "neurons"


def neurons_per_layer(screen: ScreenData) -> int | None:
    """FFN neurons (outgoing rows) per layer: the synthetic shape's, else derived from the
    worker's host outgoing bytes over layers x bytes per row (a call that copied rows gives
    the row size). None when the archive cannot say."""
    if screen.protocol.model.synth is not None and not screen.protocol.model.synth.is_moe:
        return SHAPES[screen.protocol.model.synth.shape]["ffn"]
    host = screen.start.get("host_outgoing_bytes")
    for e in screen.episodes:
        for call in e.calls:
            for rows, weight in zip(call.get("rows_copied", ()), call.get("h2d_weight_bytes", ())):
                if rows and weight and isinstance(host, int) and call.get("layers"):
                    row_bytes = weight // rows
                    ffn, rest = divmod(host, call["layers"] * row_bytes)
                    return ffn if ffn and not rest else None
    return None


# ----------------------------------------------------------------------------- series


def call_h2d(call: dict) -> int:
    """Host-to-device bytes of one call: weights + indices over its layers."""
    return sum(call["h2d_weight_bytes"]) + sum(call["h2d_index_bytes"])


def h2d_per_call(screen: ScreenData) -> dict[str, dict[str, list[int]]]:
    """condition -> phase -> H2D bytes of every call of its scored episodes, in plan order."""
    out = {c: {ph: [] for ph in PHASES} for c in screen.conditions}
    if not screen.protocol.recording:  # no ledger ran: its calls' byte counts are zeros, not transfers
        return out
    for c in screen.conditions:
        for e in screen.of(c):
            for call in e.calls:
                out[c][call["phase"]].append(call_h2d(call))
    return out


def wall_per_episode(screen: ScreenData) -> dict[str, list[tuple[int, float]]]:
    """condition -> (plan index, wall_s) of its finished scored episodes."""
    return {c: [(e.index, e.record["wall_s"]) for e in screen.of(c)] for c in screen.conditions}


def runtime_intervals(screen: ScreenData) -> list[dict]:
    """Per condition other than the reference: the paired whole-episode runtime ratio against
    the reference, with its bootstrap interval.

    From the protocol's own runtime gate (phase `all`) where it declares one: the verdict as
    archived, with `source` "gate". Otherwise computed by that gate's function with its default
    interval (0.95, 10000 resamples, seed 0) and no threshold, `source` "computed".
    """
    declared = {g.control: g for g in screen.protocol.gates.runtime if g.phase == "all"}
    verdicts = {v["condition"]: v for v in screen.verdicts if v.get("gate") == "runtime" and v.get("phase") == "all"}
    records = [{**e.record, "repetition": e.repetition} for e in screen.episodes]
    out = []
    ref = screen.protocol.reference
    control = next(iter(declared), ref)
    for c in screen.conditions:
        if c == control:
            continue
        if control in declared and c in verdicts:
            v = verdicts[c]
            out.append({"condition": c, "control": control, "value": v["value"], "interval": v["interval"],
                        "threshold": v["threshold"], "passed": v["passed"], "source": "gate"})
            continue
        # The gate's own pairing and bootstrap; the bound is moot here (no threshold is claimed).
        v = runtime(records, condition=c, control=control, max_ratio=sys.float_info.max, confidence=DEFAULT_CONFIDENCE,
                    resamples=DEFAULT_RESAMPLES, seed=DEFAULT_SEED)
        out.append({"condition": c, "control": control, "value": v["value"], "interval": v["interval"],
                    "threshold": None, "passed": None, "source": "computed"})
    return out


def serving_rows(screen: ScreenData) -> list[dict]:
    """One row per condition (protocol order) with its tier: the serving figures of its scored
    finished episodes (core.serving.condition_serving; docs/metrics.md defines each)."""
    records = [e.record for e in screen.episodes]
    return [{"condition": c.name, "tier": c.tier, **condition_serving(scored_ok(records, c.name)),
             "ttft_first_s": first_use_ttft(records, c.name)} for c in screen.protocol.conditions]


def expert_cache_rows(screen: ScreenData) -> list[dict]:
    """One row per expert-cache or expert-forecast condition (protocol order) over its scored
    finished episodes: the measured hit rate beside Belady's for the same capacity on the same
    routing (every call, and decode calls alone), the ready rate ((hits + forecast used) / routed),
    the forecast's prefetched, used and wasted experts, and host-to-device bytes per decode token (core/expert_cache.py; docs/metrics.md).
    Rates are summed hits over summed routed experts; None where nothing was routed."""
    keys = ("routed", "hits", "belady_hits", "prefetched", "used", "wasted")
    out = []
    for c in screen.protocol.conditions:
        eps = [e for e in screen.episodes
               if e.condition == c.name and e.scored and e.ok and isinstance(e.record.get("experts"), dict)]
        mine = [e.record for e in eps]
        if not mine:
            continue
        total = {k: sum(r["experts"][k] for r in mine) for k in keys}
        decode = {k: sum(r["experts"]["decode"][k] for r in mine) for k in ("routed", "hits", "belady_hits", "used")}
        # Per token: a decode call at batch B feeds B tokens (`packbench simulate` divides alike).
        tokens = sum(call.get("tokens", 1) for e in eps for call in e.calls if call.get("phase") == "decode")
        decode_h2d = sum(r.get("phases", {}).get("decode", {}).get("h2d_bytes", 0) for r in mine)
        x = mine[0]["experts"]
        cache = f"{x['capacity']} {x['rule']}" if x["capacity"] else "no cache"
        out.append({"condition": c.name, "tier": c.tier, "episodes": len(mine), "capacity": x["capacity"],
                    "rule": x["rule"], "forecast": x["forecast"],
                    "cache": cache + (" + forecast" if x["forecast"] == "on" else ""), **total,
                    "hit_rate": _rate(total["hits"], total["routed"]),
                    "belady_rate": _rate(total["belady_hits"], total["routed"]),
                    "ready_rate": _rate(total["hits"] + total["used"], total["routed"]),
                    "decode_hit_rate": _rate(decode["hits"], decode["routed"]),
                    "decode_belady_rate": _rate(decode["belady_hits"], decode["routed"]),
                    "decode_ready_rate": _rate(decode["hits"] + decode["used"], decode["routed"]),
                    "decode_bytes_per_token": decode_h2d / tokens if tokens else None})
    return out


def _rate(hits: int, total: int) -> float | None:
    return hits / total if total else None


def first_use_ttft(records: list[dict], condition: str) -> float | None:
    """Cold TTFT: the prefill call of the condition's first finished episode in the screen (a
    warmup where it has one: its first use in the worker); the `ttft_s` of serving_rows is the
    warm one, the median over scored episodes (docs/metrics.md)."""
    mine = sorted((r for r in records if r.get("condition") == condition and r.get("status") == "ok"),
                  key=lambda r: r.get("plan_index", 0))
    for r in mine:
        f = episode_serving(r)
        if f is not None:
            return f["ttft_s"]
    return None


FIRST_IN_WORKER = "nothing (first in the worker)"


def steady_by_previous(screen: ScreenData) -> list[dict]:
    """Per condition (protocol order), its steady decode call split by the condition the worker ran
    just before each scored episode (core.serving.by_previous): a figure that moves with what ran
    before is interference, not the condition's own speed. [{condition, tier, previous: [{condition,
    n, median}]}]."""
    records = [e.record for e in screen.episodes]
    out = []
    for c in screen.protocol.conditions:
        split = by_previous(records, c.name)
        if split:
            out.append({"condition": c.name, "tier": c.tier,
                        "previous": [{"condition": FIRST_IN_WORKER if p is None else p, "n": v["n"],
                                      "median": v["median"]} for p, v in split.items()]})
    return out


def runtime_ratios(screen: ScreenData) -> list[dict]:
    """Beside each runtime reading of `runtime_intervals` (the frozen gate's summed walls and its
    bootstrap bound, or that gate's function where none is declared): the ratio of median walls
    over the same pairs with its paired interval, the outliers beyond 3 IQR, and whether the two
    disagree (core.serving.robust_runtime). Each row keeps the condition's tier."""
    records = [{**e.record, "repetition": e.repetition} for e in screen.episodes]
    tiers = {c.name: c.tier for c in screen.protocol.conditions}
    declared = {g.control: g for g in screen.protocol.gates.runtime if g.phase == "all"}
    out = []
    for row in runtime_intervals(screen):
        g = declared.get(row["control"])  # the gate's own interval settings, where it declares them
        robust = robust_runtime(records, condition=row["condition"], control=row["control"], gate=row,
                                confidence=g.confidence if g and g.confidence else DEFAULT_CONFIDENCE,
                                resamples=g.resamples if g and g.resamples else DEFAULT_RESAMPLES,
                                seed=g.seed if g and g.seed is not None else DEFAULT_SEED)
        if robust is not None:
            out.append({**robust, "tier": tiers.get(row["condition"]), "passed": row["passed"],
                        "source": row["source"]})
    return out


def plan_positions(screens: list[ScreenData]) -> dict:
    """core.serving.position_check over one or more screens of one protocol."""
    prompts = screens[0].protocol.prompt_count if screens else None
    return position_check([[{**e.record, "repetition": e.repetition} for e in s.episodes] for s in screens],
                          prompts=prompts)


def headline(screen: ScreenData) -> list[str]:
    """What won, by how much, one line per tier (exact and approximate are never ranked together):
    the conditions ordered by their steady decode call (the median decode call but each episode's
    first: one rule for every condition, docs/metrics.md), the fastest named with its factor over
    the tier's slowest and over the reference, and its TPOT and once-per-episode cost apart, every
    condition whose fidelity gate failed named `(fidelity FAIL)`; then one line per runtime reading: the frozen gate beside the ratio of medians, and whether the two
    disagree."""
    lines = []
    ref = screen.protocol.reference
    rows = serving_rows(screen)
    steady = {r["condition"]: r["steady_call_s"] for r in rows}
    # An approximate condition whose fidelity gate failed is named so wherever it is ranked: an nf4
    # of mean KL 0.47 read as its tier's plain winner.
    failed = {v["condition"] for v in screen.verdicts if v.get("gate") == "fidelity" and not v.get("passed")}

    def name(c: str) -> str:
        return f"{c} (fidelity FAIL)" if c in failed else c

    for tier in ("exact", "approximate"):
        ranked = sorted((r for r in rows if r["tier"] == tier and r["steady_call_s"]), key=lambda r: r["steady_call_s"])
        if not ranked:
            continue
        best, worst = ranked[0], ranked[-1]
        text = (f"{tier.capitalize()} tier, by the steady decode call ({best['episodes']} scored episode"
                f"{'' if best['episodes'] == 1 else 's'}): "
                f"{name(best['condition'])} {best['steady_call_s'] * 1e3:.3g} ms")
        # Its TPOT beside its own figure: after the slowest's or the reference's name it read as theirs.
        if best["tpot_s"] is not None:
            text += f" (its TPOT {best['tpot_s'] * 1e3:.3g} ms"
            once = best["first_decode_excess_s"]
            text += f", once per episode {once * 1e3:+.3g} ms)" if once is not None else ")"
        if len(ranked) > 1:
            text += f", {worst['steady_call_s'] / best['steady_call_s']:.3g}x faster than the slowest, {name(worst['condition'])}"
        if ref not in (best["condition"], worst["condition"]) and steady.get(ref):
            factor = steady[ref] / best["steady_call_s"]  # below 1 where the reference (another tier) is faster
            text += (f", {factor:.3g}x faster than the reference" if factor >= 1 else
                     f", {1 / factor:.3g}x slower than the reference") + f" {ref} ({steady[ref] * 1e3:.3g} ms)"
        text += "; order: " + ", ".join(f"{name(r['condition'])} {r['steady_call_s'] * 1e3:.3g}" for r in ranked) + " ms"
        lines.append(text)
    for r in runtime_ratios(screen):
        m = r["median"]
        # No summed walls where the gate has no reading (its pairs incomplete, or no runtime gate):
        # the line says so rather than leaving an empty ": ;" before the ratio of medians.
        gate = "no summed walls" if r["gate_value"] is None else f"summed walls {r['gate_value']:.3g}"
        if r["passed"] is not None:
            bound = f", bound {r['gate_interval'][1]:.3g}" if r["gate_interval"] else ""
            gate = f"runtime gate {'PASS' if r['passed'] else 'FAIL'} ({gate}{bound})"
        text = (f"{r['condition']} ({r['tier']}) over {r['control']}: {gate}; ratio of medians {m['value']:.3g} "
                f"[{m['interval'][0]:.3g}, {m['interval'][1]:.3g}]")
        if r["disagree"]:
            text += f"; the two readings disagree {r['because']}"
        lines.append(text)
    return lines


def decode_ms_per_token(screen: ScreenData) -> dict[str, list[float]]:
    """condition -> milliseconds per generated token of every decode call of its scored episodes."""
    return {c: [1e3 * call["wall_s"] / call["tokens"] for e in screen.of(c) for call in e.calls
                if call["phase"] == "decode"] for c in screen.conditions}


def memory_traces(screen: ScreenData) -> dict[str, list[tuple[int, np.ndarray]]]:
    """condition -> (plan index, (samples, 2) trace) of every episode with samples, warmups included
    (the resources gate judges them too)."""
    out: dict[str, list[tuple[int, np.ndarray]]] = {c: [] for c in screen.conditions}
    for e in screen.episodes:
        if e.trace is not None and e.trace.ndim == 2 and e.trace.shape[0] and e.trace.shape[1] == 2:
            out[e.condition].append((e.index, e.trace))
    return out


def activity_condition(screen: ScreenData) -> str | None:
    """The first condition (protocol order) whose scored ledgers observed active rows. The active
    set is a property of the prompt and the model, not the policy (logits are bit-identical), so
    one condition shows it; dense-stream observes none."""
    for c in screen.conditions:
        for e in screen.of(c):
            if any(v is not None for call in e.calls for v in call["active_rows"]):
                return c
    return None


def active_heatmap(screen: ScreenData) -> dict | None:
    """The active rows of `activity_condition` per layer over its scored calls in plan order:
    {condition, rows: (layers, calls) float array (NaN where not observed), fraction: whether
    rows are divided by neurons per layer, episodes: [(plan index, first call column)], phases}."""
    c = activity_condition(screen)
    if c is None:
        return None
    ffn = neurons_per_layer(screen)
    columns, episodes, phases = [], [], []
    for e in screen.of(c):
        episodes.append((e.index, len(columns)))
        for call in e.calls:
            columns.append([math.nan if v is None else (v / ffn if ffn else v) for v in call["active_rows"]])
            phases.append(call["phase"])
    return {"condition": c, "rows": np.array(columns, dtype=np.float64).T, "fraction": ffn is not None,
            "neurons": ffn, "unit": unit_name(screen), "episodes": episodes, "phases": phases}


def union_sparsity(screen: ScreenData) -> dict | None:
    """Active fraction of neurons (the union over the call's tokens, mean over layers) against
    the number of tokens in the call, for every scored call of `activity_condition`:
    {condition, points: [(tokens, fraction)], curve: [(tokens, median fraction)]}."""
    c = activity_condition(screen)
    ffn = neurons_per_layer(screen)
    if c is None or not ffn:
        return None
    points = []
    for e in screen.of(c):
        for call in e.calls:
            seen = [v for v in call["active_rows"] if v is not None]
            if seen:
                points.append((call["tokens"], statistics.fmean(seen) / ffn))
    by_tokens: dict[int, list[float]] = {}
    for t, f in points:
        by_tokens.setdefault(t, []).append(f)
    curve = [(t, statistics.median(fs)) for t, fs in sorted(by_tokens.items())]
    return {"condition": c, "neurons": ffn, "unit": unit_name(screen), "points": points, "curve": curve}


def workload_by_layer(screen: ScreenData) -> dict | None:
    """Each layer's active fraction in the scored decode calls and prefill calls of
    `activity_condition` (the workload's activity, whatever the policy), beside what the
    checkpoint's profile targets (a synthetic model.synth with a profile) and real OPT's
    measured figures of the same shape and prefix (core/workloads.py):
    {condition, decode: [per layer], prefill: [per layer], target: [per layer] | None,
    anchors: [(label, value)], shape}."""
    from packbench.core.registry import PROFILES
    from packbench.core.workloads import ANCHORS

    c = activity_condition(screen)
    ffn = neurons_per_layer(screen)
    if c is None or not ffn:
        return None
    sums: dict[str, list[list[float]]] = {"decode": [], "prefill": []}
    for e in screen.of(c):
        for call in e.calls:
            if call["phase"] in sums and all(v is not None for v in call["active_rows"]):
                sums[call["phase"]].append([v / ffn for v in call["active_rows"]])
    if not sums["decode"] and not sums["prefill"]:
        return None
    by_layer = {phase: np.mean(np.array(rows, dtype=np.float64), axis=0).tolist() if rows else []
                for phase, rows in sums.items()}
    synth = screen.protocol.model.synth
    shape = synth.shape if synth is not None else None
    target = PROFILES[synth.profile].layer_densities(shape) if synth is not None and synth.profile else None
    prefix = screen.protocol.prefix_tokens
    anchors = [(f"real {a.shape}: {a.label}", a.value) for a in ANCHORS
               if a.shape == shape and a.prefix_tokens == prefix and a.key.split(".")[1] in
               ("decode_packet_over_dense", "prefill_packet_over_dense")]
    return {"condition": c, **by_layer, "target": target, "anchors": anchors, "shape": shape,
            "unit": unit_name(screen)}


def energy(screen: ScreenData) -> dict[str, list[dict]]:
    """condition -> {index, energy_j, tokens, j_per_token} of its finished scored episodes that
    carry an energy reading (NVML's counter: none on the CPU)."""
    out: dict[str, list[dict]] = {c: [] for c in screen.conditions}
    for c in screen.conditions:
        for e in screen.of(c):
            j = e.record.get("energy_j")
            tokens = token_count(e.record.get("tokens"))
            if isinstance(j, (int, float)) and not isinstance(j, bool) and math.isfinite(j) and tokens:
                out[c].append({"index": e.index, "energy_j": float(j), "tokens": tokens, "j_per_token": j / tokens})
    return out


def other_processes(record: dict) -> list[tuple[int, int]]:
    """(pid, most device memory held) of every other process the worker's memory sampler saw on
    the GPU during this episode. Only well-formed [pid, bytes] pairs count (an archive is read
    without trusting its types)."""
    sampler = record.get("sampler")
    others = sampler.get("other_processes") if isinstance(sampler, dict) else None
    return [(p[0], p[1]) for p in (others if isinstance(others, list) else [])
            if isinstance(p, list) and len(p) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in p)]


def gpu_sharing(screen: ScreenData) -> dict:
    """`shared_gpu` over the screen's episodes."""
    return shared_gpu(e.record for e in screen.episodes)


def shared_gpu(records) -> dict:
    """{episodes: plan indices, processes: {pid: most device memory held}} over episode records
    (`other_processes`): a shared GPU means timings that may be contaminated."""
    episodes, processes = [], {}
    for record in records:
        pairs = other_processes(record)
        if pairs:
            episodes.append(record.get("plan_index"))
        for pid, used in pairs:
            processes[pid] = max(processes.get(pid, 0), used)
    return {"episodes": episodes, "processes": processes}


def other_workers(record: dict) -> list[tuple[int, str]]:
    """(pid, device) of every other packbench worker busy (loading or running an episode) on the
    worker's host at some moment of this episode (`host_workers`, engine/gpu_lock.py): they share
    its cores and memory. Only well-formed [pid, device] pairs count (an archive is read without
    trusting its types)."""
    pairs = record.get("host_workers")
    return [(p[0], p[1][:80]) for p in (pairs if isinstance(pairs, list) else [])
            if isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
            and p[0] >= 0 and isinstance(p[1], str)]


def host_sharing(screen: ScreenData) -> dict:
    """`shared_host` over the screen's episodes."""
    return shared_host(e.record for e in screen.episodes)


def shared_host(records) -> dict:
    """{episodes: plan indices, workers: {pid: device}} over episode records (`host_workers`):
    other packbench workers on the host mean host-side timings (gathers, copies) that may be
    contaminated, even on a GPU of the screen's own."""
    episodes, workers = [], {}
    for record in records:
        pairs = other_workers(record)
        if pairs:
            episodes.append(record.get("plan_index"))
        workers.update(pairs)
    return {"episodes": episodes, "workers": workers}


def condition_summary(screen: ScreenData) -> list[dict]:
    """One row per condition: policy, scored episodes, mean H2D bytes per prefill / decode call,
    mean wall per episode and the spread of the walls (n, median, p10, p90: core/dispersion.py),
    median decode ms/token and its spread, largest sampled GPU peak, energy."""
    h2d, walls, dec, en = h2d_per_call(screen), wall_per_episode(screen), decode_ms_per_token(screen), energy(screen)
    recorded = screen.protocol.recording  # false: no ledger ran, its zero byte counts are not transfers
    rows = []
    for cond in screen.protocol.conditions:
        c = cond.name
        scored = screen.of(c, ok_only=False)
        peaks = [e.record.get("memory", {}).get("peak_sampled_bytes") for e in screen.of(c, scored_only=False)]
        peaks = [p for p in peaks if isinstance(p, int)]
        j = [x["energy_j"] for x in en[c]]
        tokens = sum(x["tokens"] for x in en[c])
        fid = [e.record["fidelity"] for e in scored if e.ok and isinstance(e.record.get("fidelity"), dict)]
        kl = [f["mean_kl"] for f in fid if isinstance(f.get("mean_kl"), (int, float))]
        top1 = [f["top1"] for f in fid if isinstance(f.get("top1"), (int, float))]
        rows.append({
            "condition": c, "policy": cond.policy, "tier": cond.tier,
            # approximate conditions: the worst scored episode's fidelity (the gate bounds each)
            "fidelity_mean_kl_max": max(kl) if kl else None, "fidelity_top1_min": min(top1) if top1 else None,
            # defaults spelled out; a parameter the worker chose (omitted: None) as its episodes recorded it
            "params": ", ".join(f"{k}={v}" if v is not None else f"{k}={_chosen(k, scored)} (chosen)"
                                for k, v in cond.resolved_params.items()),
            "scored": len(scored), "failed": sum(not e.ok for e in scored),
            "prefill_h2d_per_call": _mean(h2d[c]["prefill"]) if recorded else None,
            "decode_h2d_per_call": _mean(h2d[c]["decode"]) if recorded else None,
            "wall_s_mean": _mean([w for _, w in walls[c]]), "decode_ms_median": _median(dec[c]),
            "wall_s_spread": spread([w for _, w in walls[c]]), "decode_ms_spread": spread(dec[c]),
            "peak_sampled_bytes": max(peaks) if peaks else None,
            "energy_j_per_episode": _mean(j), "energy_j_per_token": math.fsum(j) / tokens if tokens else None,
        })
    return rows


def measurement_cost(screen: ScreenData) -> dict:
    """What the measurement itself cost: the protocol's `passes` (together: the ledger and the
    sampler ran inside the timed calls; separate: core/passes.py), whether it recorded, and with
    separate passes, per condition, the figures of `core.passes.overhead` (in protocol order)."""
    cost = overhead(e.record for e in screen.episodes)
    return {"passes": screen.protocol.passes, "recording": screen.protocol.recording,
            "conditions": [{"condition": c, **cost[c]} for c in screen.conditions if c in cost]}


def frontier(screen: ScreenData) -> dict:
    """The frontier view: one point per condition, its median decode ms per token against the
    device memory it needed, with its tier and, for an approximate condition, its worst scored
    fidelity and its fidelity verdict. Memory is the largest sampled GPU peak when any episode
    sampled one (`memory: sampled`); a CPU run samples none, so it is what the condition held
    on the device instead (`memory: held`: device parameters + policy buffers + KV cache, the
    largest over its scored episodes; for an approximate condition its quantized model + KV
    cache), and the figure says which."""
    dec = decode_ms_per_token(screen)
    sampled = any(isinstance(e.record.get("memory", {}).get("peak_sampled_bytes"), int) for e in screen.episodes)
    verdicts = {v["condition"]: v for v in screen.verdicts if v.get("gate") == "fidelity"}
    points = []
    for row in condition_summary(screen):
        c = row["condition"]
        held = []
        for e in screen.of(c):
            m = e.record.get("memory") or {}
            # an approximate condition runs on its quantized model alone (policy_device_bytes), not
            # on the CPU-first model's device parameters
            keys = ("policy_device_bytes", "kv_bytes") if row["tier"] == "approximate" else (
                "device_param_bytes", "policy_device_bytes", "kv_bytes")
            parts = [m.get(k) for k in keys]
            if all(isinstance(x, int) for x in parts):
                held.append(sum(parts))
        memory = row["peak_sampled_bytes"] if sampled else (max(held) if held else None)
        v = verdicts.get(c)
        points.append({"condition": c, "tier": row["tier"], "decode_ms": _median(dec[c]), "memory_bytes": memory,
                       "fidelity_mean_kl_max": row["fidelity_mean_kl_max"], "fidelity_top1_min": row["fidelity_top1_min"],
                       "fidelity_passed": None if v is None else bool(v["passed"])})
    return {"memory": "sampled" if sampled else "held", "points": points}


def _mean(xs: list) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def _chosen(name: str, episodes) -> str:
    """The value a worker chose for parameter `name` of a condition that left it out, as its finished
    episodes recorded it in their `offload` section (flexgen's `policy.w_gpu_percent`, llama-cpp's
    `placement.n_cpu_moe`): one value, or the distinct ones joined by "/", or "?" where none says."""
    seen = []
    for e in episodes:
        offload = e.record.get("offload") if e.ok else None
        for section in (offload or {}).values() if isinstance(offload, dict) else ():
            if isinstance(section, dict) and name in section and section[name] not in seen:
                seen.append(section[name])
    return "/".join(str(v) for v in seen) or "?"


def _median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------- verdict display


ALLOWANCE_GATES = ("resources", "capacity")  # threshold = the protocol's allowance_mib, in bytes


def threshold_text(verdict: dict, protocol: Protocol) -> str:
    """A verdict's threshold as the protocol wrote it: `512 MiB` for the allowance-based gates
    (resources, capacity), the ratio or tolerance otherwise (repr: the decimal written)."""
    t = verdict.get("threshold")
    if t is None:
        return "-"
    if verdict.get("gate") in ALLOWANCE_GATES and t == protocol.allowance_bytes:
        return f"{protocol.allowance_mib} MiB"
    if verdict.get("gate") == "useful_latency":
        return f"{t!r} s"
    if verdict.get("gate") == "fidelity":  # its first threshold, bounding from the side the detail says
        side = ">=" if "(bound >=" in (verdict.get("detail") or "").split(";")[0] else "<="
        return f"{side} {t!r}"
    return repr(t)


def value_text(verdict: dict) -> str:
    """A verdict's value with its unit: MiB (and bytes) for byte values, seconds, ratios."""
    v = verdict.get("value")
    if v is None:
        return "-"
    if verdict.get("gate") in ALLOWANCE_GATES:
        return f"{v / MIB:.1f} MiB ({int(v):,} B)"
    if verdict.get("gate") == "useful_latency":
        return f"{v:.4g} s"
    return f"{v:.6g}"


def interval_text(verdict: dict) -> str:
    i = verdict.get("interval")
    return "-" if not i else f"[{i[0]:.4g}, {i[1]:.4g}]"


# ----------------------------------------------------------------------------- several screens


def verdict_agreement(screens: list[ScreenData]) -> dict:
    """Across screens: every (gate, condition, phase) any screen judged, with each screen's
    passed (None where it has no such verdict), whether the screens that judged it agree, and
    the counts {judged_by_all, agree}: the cross-machine verdict agreement when the screens
    ran one protocol on several machines."""
    keys: dict[tuple, list] = {}
    for n, s in enumerate(screens):
        for v in s.verdicts:
            key = (v["gate"], v["condition"], v.get("phase", "all"))
            keys.setdefault(key, [None] * len(screens))[n] = bool(v["passed"])
    rows = []
    for key in sorted(keys):
        passed = keys[key]
        judged = [p for p in passed if p is not None]
        rows.append({"gate": key[0], "condition": key[1], "phase": key[2], "passed": passed,
                     "all_judged": len(judged) == len(screens), "agree": len(set(judged)) <= 1})
    common = [r for r in rows if r["all_judged"]]
    return {"rows": rows, "judged_by_all": len(common), "agree": sum(r["agree"] for r in common),
            "same_protocol": len({s.protocol.sha256 for s in screens}) == 1}
