"""Assemble a report page: sections of tables and plots over core.report's derived series.

`screen_page` writes one screen; `compare_page` puts several side by side. Both return the
whole HTML document as a string (cli/report_template.py holds the page and its styles).
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Iterable

from packbench.cli import report_figures as figs
from packbench.cli.summary import detail_text, fidelity_caveat
from packbench.cli.report_template import CSS, PAGE
from packbench.core import report as data
from packbench.core import serving
from packbench.core.protocol import MIB
from packbench.core.dispersion import noisy_host, spread
from packbench.core.report import ScreenData

PLOT_CAPTIONS = {
    "h2d": "Host-to-device bytes (outgoing weights + indices) of every call of the scored episodes; bar: the mean, "
           "in MB above it, with its share of the reference's mean.",
    "wall": "Left: wall time of every scored episode. Right: the paired (repetition, prompt) whole-episode time ratio "
            "to the control, with its bootstrap interval: the runtime gate's ratio of summed walls, which one slow "
            "episode moves; the ratio of medians beside it is in the runtime ratio table above.",
    "decode": "Milliseconds per generated token of every decode call of the scored episodes (box: quartiles).",
    "memory": "GPU memory sampled by NVML during every episode (warmups included), against the protocol's allowance.",
    "heatmap": "Active outgoing rows (an MoE model's routed experts) per layer over the calls of the scored "
               "episodes, in plan order.",
    "union": "Active fraction of neurons (an MoE model's experts; the union over a call's tokens) against the tokens "
             "in the call.",
    "workload": "Each layer's active fraction in decode and prefill calls; dashed, what the synthetic profile "
                "targets per token; dotted, real OPT's measured mean for this shape and prefix (docs/workloads.md). "
                "`packbench model stats` gives every figure of a checkpoint.",
    "energy": "GPU energy (NVML counter) per scored episode and per generated token.",
    "frontier": "One point per condition: median decode ms per token against the device memory it needed "
                "(the largest sampled GPU peak; on a CPU run, which samples none, what it held on the device). "
                "Circles are exact conditions, triangles approximate ones (hollow: fidelity gate failed), "
                "labelled with their worst scored mean KL and top-1 agreement: the two tiers are never one ranking. "
                "A name that would overlap another is left to the legend.",
}


@dataclass(frozen=True)
class AuditStatus:
    """What the database says about audits of this archive: `rows` oldest first, each
    {result, machine, started, finished, digest, problems}; `source` None when no database
    was consulted; `note` a line to show (e.g. the database holds another file); `attempt` the
    attempt that wrote it, {number, status, error}, where the database knows it (the error is
    kept there only: a died worker writes no line of it into its archive)."""

    source: str | None = None
    rows: list[dict] = field(default_factory=list)
    note: str | None = None
    attempt: dict | None = None


# Bidirectional controls (embeddings, overrides, isolates, marks): a protocol named with U+202E
# reversed the rest of the title, `screen 2, attempt 1` reading `1 tpmetta ,2 neercs`.
BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def esc(value: Any) -> str:
    """Text for the page: escaped, and a bidirectional control written as its escape (`\\u202e`),
    as the terminal tables write it (core.text.one_line), so it reorders nothing around it."""
    text = "-" if value is None else str(value)
    return html.escape(BIDI.sub(lambda m: ascii(m.group())[1:-1], text))


def _num(value: Any, fmt: str = "{:,.4g}") -> str:
    if value is None:
        return Markup('<td class="num none">-</td>')
    return Markup(f'<td class="num">{esc(fmt.format(value))}</td>')


def html_table(head: Iterable[str], rows: Iterable[Iterable[Any]], *, cls: str = "") -> str:
    """Rows of already-rendered <td> cells (`Markup`) or plain text (escaped), in a box that
    scrolls sideways when the table is wider than the page. A cell is HTML only by its type: a
    protocol named `<td>...` is text like any other."""
    klass = f' class="{cls}"' if cls else ""
    out = [f'<div class="scroll"><table{klass}><thead><tr>', *(f"<th>{esc(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>" + "".join(c if isinstance(c, Markup) else f"<td>{esc(c)}</td>" for c in row) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def html_facts(pairs: Iterable[tuple[str, Any]]) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{esc(k)}</dt><dd>{v if isinstance(v, Markup) else esc(v)}</dd>"
                                          for k, v in pairs) + "</dl>"


class Markup(str):
    """Already-escaped HTML."""


def _mono(text: Any) -> Markup:
    return Markup(f'<code>{esc(text)}</code>')


SHORT_NAME = 16  # characters: a name this short stays on one line (every policy's own name fits)


def name_cell(condition: str) -> Markup:
    """A condition's name in a cell: whole on one line when short (a squeezed table broke
    `dense-stream` at its hyphen), else wrapping anywhere (a 200-character name of letters, digits,
    `.`, `_`, `-`, no space to break at, in a nowrap cell pushed its table's other columns off the
    page)."""
    kind = "name short" if len(condition) <= SHORT_NAME else "name"
    return Markup(f'<td class="{kind}">{esc(condition)}</td>')


def _passed(p: bool | None) -> str:
    if p is None:
        return Markup('<td class="none">-</td>')
    return Markup('<td class="pass">PASS</td>') if p else Markup('<td class="fail">FAIL</td>')


def _audit_cell(result: str) -> str:
    """A stored audit's result: AGREE, DISAGREE, or PARTIAL (an unfinished attempt's archive whose
    every member checks: what the attempt left, not a disagreement)."""
    if result == "partial":
        return Markup('<td class="none">PARTIAL</td>')
    return Markup('<td class="pass">AGREE</td>') if result == "agree" else Markup('<td class="fail">DISAGREE</td>')


def plot_figure(name: str, svg: str | None, missing: str, caption: str | None = None) -> str:
    if svg is None:
        return f'<p class="missing" data-missing="{esc(name)}">{esc(missing)}</p>'
    return (f'<figure class="plot" data-plot="{esc(name)}">{svg}'
            f'<figcaption>{esc(caption or PLOT_CAPTIONS.get(name, ""))}</figcaption></figure>')


def _mb(value: float | None) -> str:
    return _num(None if value is None else value / 1e6, "{:,.4g} MB")


def _mib(value: float | None) -> str:
    return _num(None if value is None else value / MIB, "{:,.1f} MiB")


# ----------------------------------------------------------------------------- sections


def protocol_section(s: ScreenData) -> str:
    p = s.protocol
    # Full width below the facts, its parameters free to wrap: beside them, in half the page, a
    # competitor's parameters ran past the table's box at 1400 px.
    conditions = html_table(["condition", "tier", "policy", "params", "warmups"],
                            [[name_cell(c.name), c.tier, c.policy,
                              Markup(f'<td class="wrap">{esc(json.dumps(c.resolved_params) if c.resolved_params else "-")}</td>'),
                              str(p.warmups[c.name])] for c in p.conditions], cls="conditions")
    prompts = p.prompts
    source = {"generator": f"generator (seed {prompts.seed})", "token_ids": "inline token ids"}.get(
        prompts.source, f"{prompts.source} {prompts.path} (sha256 {(prompts.sha256 or '')[:16]})")
    freeze = s.manifest.get("source_freeze") or {}
    return "".join([
        '<h2 id="protocol">Protocol</h2><div class="grid"><div>',
        html_facts([("name", p.name), ("frozen SHA-256", _mono(p.sha256)), ("schema", p.body.get("schema", 1)),
                ("model", data.model_label(s)), ("dtype", p.dtype),
                ("prompts", f"{prompts.count} from {source}"),
                ("tokens", f"{p.prefix_tokens} prefix + {p.continuation_tokens} generated "
                           f"(1 prefill + {p.continuation_tokens - 1} decode calls)"),
                ("batch", _batch(p)),
                *([("scored prompts", f"{p.scored_prompts} of {prompts.count} start a scored episode each repetition")]
                  if p.scored_prompts < prompts.count else []),
                ("reference", p.reference), ("repetitions", p.repetitions),
                ("order", f"{p.order}{', reference first' if p.baseline_first else ''}"),
                ("allowance", f"{p.allowance_mib} MiB"), ("recording", p.recording), ("passes", p.passes),
                ("planned episodes", s.planned)]),
        "</div><div>",
        "<h3>Gates as frozen</h3>", _gates_table(p.full_dict()["gates"]),
        "</div></div>", "<h3>Conditions as frozen</h3>", conditions,
        "<h3>Source freeze</h3>",
        html_facts([("package version", freeze.get("package_version")), ("git commit", _mono(freeze.get("git_commit"))),
                ("git dirty", freeze.get("git_dirty")), ("engine SHA-256", _mono(freeze.get("engine_sha256")))])
        if freeze else '<p class="missing">the archive has no source freeze (no manifest)</p>',
    ])


def _batch(p) -> str:
    """The protocol's batch as the page says it: a batched screen's calls each decode B sequences,
    so its decode call (TPOT, ITL, the steady call) covers B tokens where ms/token covers one."""
    if p.batch == 1:
        return "1"
    return f"{p.batch}: every call decodes {p.batch} prompts together (a decode call is {p.batch} tokens)"


def _gates_table(gates: dict) -> str:
    rows = []
    for gate, spec in gates.items():
        for entry in spec if isinstance(spec, list) else [spec]:
            text = ", ".join(f"{k} {v}" for k, v in entry.items()) if isinstance(entry, dict) else str(entry)
            rows.append([gate, Markup(f'<td class="wrap">{esc(text or "-")}</td>')])
    return html_table(["gate", "parameters"], rows)


def _gpu(s: ScreenData) -> str:
    """The GPU the screen ran on, `CPU`, or, where the archive records no environment (a screen
    that failed before its worker wrote one), unknown: such a page said `CPU` of any machine."""
    if not s.environment:
        return "unknown (no environment recorded)"
    return s.environment.get("gpu") or "CPU"


def machine_section(s: ScreenData) -> str:
    env, start = s.environment, s.start
    cold = [e.record.get("first_logit_since_entry_s") for e in s.episodes if e.ok]
    cold = [c for c in cold if isinstance(c, (int, float))]
    return "".join([
        '<h2 id="machine">Machine and GPU</h2><div class="grid"><div>',
        html_facts([("host", env.get("host")), ("GPU", "none (CPU run)" if _gpu(s) == "CPU" else _gpu(s)),
                ("device", env.get("device") or start.get("device")), ("driver", env.get("driver") or "-"),
                ("torch", env.get("torch")), ("CUDA", env.get("cuda") or "-"), ("python", env.get("python"))]),
        "</div><div>",
        html_facts([("parameter bytes", _fmt_bytes(start.get("param_bytes"))),
                ("on the device at start", _fmt_bytes(start.get("device_param_bytes"))),
                ("outgoing weights on the host", _fmt_bytes(start.get("host_outgoing_bytes"))),
                ("CPU-first", start.get("cpu_first")),
                ("allowance imposed", _fmt_bytes(start.get("allowance_bytes"))),
                ("model load", _seconds(start.get("entry_to_loaded_s"))),
                ("cold start (entry to first logit)", _seconds(min(cold) if cold else None)),
                ("model dir", s.model_dir)]),
        "</div></div>",
    ])


def _fmt_bytes(v: Any) -> str:
    return "-" if not isinstance(v, int) else f"{v:,} B ({v / MIB:,.1f} MiB)"


def _seconds(v: Any) -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v:.4g} s"


def verdict_section(s: ScreenData) -> str:
    tier = {c.name: c.tier for c in s.protocol.conditions}
    rows = [[v["gate"], name_cell(v["condition"]), tier.get(v["condition"], "-"), v.get("phase", "all"), _passed(v["passed"]),
             Markup(f'<td class="num">{esc(data.threshold_text(v, s.protocol))}</td>'),
             Markup(f'<td class="num">{esc(data.value_text(v))}</td>'), Markup(f'<td class="num">{esc(data.interval_text(v))}</td>'),
             Markup(f'<td class="detail">{esc(detail_text(v.get("detail")))}</td>')] for v in s.verdicts]
    passed = sum(bool(v["passed"]) for v in s.verdicts)
    head = f'<h2 id="verdicts">Verdicts: {passed} of {len(s.verdicts)} pass</h2>'
    if not rows:
        return head + '<p class="missing">no verdicts.json: the screen did not finish</p>'
    synth = s.protocol.model.synth
    caveat = fidelity_caveat(None if synth is None else synth.as_dict(), s.verdicts)
    return head + html_table(["gate", "condition", "tier", "phase", "verdict", "threshold", "value", "interval", "detail"],
                         rows) + (f'<p class="caveat">fidelity: {esc(caveat)}</p>' if caveat else "")


MAX_LISTED = 12  # plan indexes named in a failure row; past that the count says the rest


def attempt_failed(attempt: dict | None) -> bool:
    """Whether the report says how the attempt ({number, status, error}) ended: it ended other
    than done, or stored an error. A running attempt has not ended: its page is of the episodes
    archived so far, and said "Attempt 1 ended running" in red."""
    return attempt is not None and attempt["status"] != "running" and (attempt["status"] != "done"
                                                                          or bool(attempt["error"]))


def failure_section(s: ScreenData, audit: AuditStatus) -> str:
    """Why the attempt or its episodes failed: the attempt's stored error when it did not end
    done, and each (condition, error) of the failed episodes with the episodes it struck. Empty
    when nothing failed."""
    parts = []
    a = audit.attempt
    if attempt_failed(a):
        parts.append(f'<p class="fail" id="attempt-error">Attempt {esc(a["number"])} ended {esc(a["status"])}'
                     f'{": " + esc(a["error"]) if a["error"] else ""}</p>')
    rows = [[name_cell(f["condition"]), Markup(f'<td class="num">{len(f["episodes"])}</td>'),
             Markup(f'<td class="wrap">{esc(_indexes(f["episodes"]))}</td>'),
             Markup(f'<td class="wrap fail">{esc(f["error"])}</td>')] for f in data.failed_episodes(s)]
    if rows:
        parts.append(html_table(["condition", "failed", "episodes (plan index)", "error"], rows))
    if not parts:
        return ""
    failed = sum(len(f["episodes"]) for f in data.failed_episodes(s))
    return (f'<h2 id="failures">Failures: {failed} of {len(s.episodes)} recorded episodes failed</h2>'
            + "".join(parts))


def _indexes(indexes: list[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:MAX_LISTED])
    return shown if len(indexes) <= MAX_LISTED else f"{shown} and {len(indexes) - MAX_LISTED} more"


def _spread(sp: dict, fmt: str) -> str:
    """A median with its p10-p90 on a second line (core/dispersion.py spread); n is the scored column."""
    if not sp["n"]:
        return Markup('<td class="num none">-</td>')
    lo, hi = fmt.format(sp["p10"]), fmt.format(sp["p90"])
    return Markup(f'<td class="num">{esc(fmt.format(sp["median"]))}<br><span class="detail">{esc(lo)}-{esc(hi)}</span></td>')


def _policy(r: dict) -> str:
    """The policy with its resolved parameters below it, free to wrap: a competitor's
    `method=int8-weight-only, mode=eager` on one line pushed the table past the page."""
    params = f'<br><span class="detail">{esc(r["params"])}</span>' if r["params"] else ""
    return Markup(f'<td class="wrap">{esc(r["policy"])}{params}</td>')


def _episodes(r: dict) -> str:
    return _num(r["scored"], "{}") if not r["failed"] else Markup(f'<td class="num fail">{r["scored"]} ({r["failed"]} failed)</td>')


def _sharing_notes(s: ScreenData) -> str:
    """Red lines above the conditions: the GPU shared with other processes, the host shared with
    other packbench workers, the host busy with any other process (host_load)."""
    shared = data.gpu_sharing(s)
    warning = ""
    if shared["episodes"]:
        procs = ", ".join(f"pid {pid} holding up to {used / 2**20:.0f} MiB"
                          for pid, used in sorted(shared["processes"].items()))
        n = len(shared["episodes"])
        warning = (f'<p class="fail" id="gpu-shared">The GPU was shared: {n} episode{"s" * (n != 1)} saw other '
                   f'processes on it ({esc(procs)}); their timings may be contaminated.</p>')
    host = data.host_sharing(s)
    if host["episodes"]:
        workers = ", ".join(f"pid {pid} on {device}" for pid, device in sorted(host["workers"].items()))
        n = len(host["episodes"])
        warning += (f'<p class="fail" id="host-shared">The host was shared: {n} episode{"s" * (n != 1)} ran while '
                    f'other packbench workers were busy on it ({esc(workers)}); they share its cores and memory, '
                    f'so host-side timings (gathers, copies) may be contaminated.</p>')
    busy = noisy_host(e.record for e in s.episodes)
    if busy["episodes"]:
        n = len(busy["episodes"])
        warning += (f'<p class="fail" id="host-busy">The host was busy: in {n} of {len(s.episodes)} episodes other '
                    f'processes kept {busy["threshold"]:g} core or more busy (up to {busy["worst"]:.2g} cores, '
                    f'from /proc: each record\'s host_load); their times may be inflated.</p>')
    return warning


def _two(first: str, second: str, *, wrap: bool = False) -> str:
    """Two figures in one cell, the second smaller below: the table fits the page. `wrap`: the
    second is words that may wrap under the first (a nowrap `-1.541 first call; unshelve 2.105
    before the wall` pushed the serving table's last column past the page at 1400 px)."""
    if first == second == "-":
        return Markup('<td class="num none">-</td>')
    style = ' style="white-space: normal"' if wrap else ""
    return Markup(f'<td class="num">{esc(first)}<br><span class="detail"{style}>{esc(second)}</span></td>')


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


# Why a screen has no steady decode call (the median decode call but each episode's first): episodes
# of one decode call (continuation_tokens: 2) have decode calls, but none after the first.
NO_STEADY = "no finished scored episode has a decode call after its first"


def _no_steady(s: ScreenData) -> str:
    """Why there is no steady decode call: a screen that stopped before any scored episode finished
    (a failed or cancelled attempt) says so, where "no finished scored episode has a decode call
    after its first" read as if episodes had finished, only too short."""
    if any(s.of(c) for c in s.conditions):
        return NO_STEADY
    return f"no scored episode finished ({len(s.episodes)} of {s.planned} planned episodes recorded)"


def headline_section(s: ScreenData) -> str:
    """What won by how much, per tier, and the runtime readings that say more than their table."""
    lines = data.headline(s)
    if not lines:
        return f'<h2 id="headline">Headline</h2><p class="missing">no steady decode call to rank: {esc(_no_steady(s))}</p>'
    return '<h2 id="headline">Headline</h2><ul class="headline">' + "".join(f"<li>{esc(t)}</li>" for t in lines) + "</ul>"


def _ms_cell(seconds: float | None, outliers: list | None = None, *, first: float | None = None) -> str:
    """Milliseconds, with the hyperfine-style flag below when episodes lie beyond 3 IQR (and for
    TTFT, the cold one: the condition's first episode, its first use)."""
    if seconds is None:
        return Markup('<td class="num none">-</td>')
    cold = "" if first is None else f'<br><span class="detail">first use {first * 1e3:.4g}</span>'
    flag = serving.outlier_text(len(outliers or []))
    # the flag wraps under its figure (a nowrap cell of three flags ran past the page at 1400 px)
    below = f'<br><span class="detail fail" style="white-space: normal">{esc(flag)}</span>' if flag else ""
    return Markup(f'<td class="num">{esc(f"{seconds * 1e3:.4g}")}{cold}{below}</td>')


def _once(r: dict) -> str:
    """The first decode call over the steady one, and where it is known what it held: the graph
    captured in it, or a competitor's unshelve before the wall."""
    first = _fmt(_ms(r["first_decode_excess_s"]), "{:+.4g} first call")
    if r["capture_s"] is not None:
        return f"{first} (capture {_ms(r['capture_s']):.4g})"
    if r["unshelve_s"] is not None:
        return f"{first}; unshelve {_ms(r['unshelve_s']):.4g} before the wall"
    return first


def serving_section(s: ScreenData) -> str:
    """Serving figures per condition (docs/metrics.md), the runtime ratio of medians beside the
    frozen gate's summed walls, and the plan-position check."""
    rows = data.serving_rows(s)
    srows = [[name_cell(r["condition"]), r["tier"], _num(r["episodes"], "{}"),
              _ms_cell(r["ttft_s"], r["outliers"]["ttft_s"], first=r["ttft_first_s"]),
              _ms_cell(r["tpot_s"], r["outliers"]["tpot_s"]),
              _two(_fmt(_ms(r["itl_p50_s"]), "{:.4g}"), "-" if r["itl_p90_s"] is None else (
                   _fmt(_ms(r["itl_p90_s"]), "p90 {:.4g}") + " / " + _fmt(_ms(r["itl_p99_s"]), "p99 {:.4g}"))),
              _num(r["decode_tokens_per_s"], "{:,.4g}"), _ms_cell(r["wall_s"], r["outliers"]["wall_s"]),
              _two(_fmt(_ms(r["outside_s"]), "{:.4g}"), _fmt(_ms(r["outside_wall_s"]), "outside the wall {:.4g}")),
              _two(_fmt(_ms(r["steady_call_s"]), "{:.4g}"), _once(r), wrap=True)] for r in rows]
    table = html_table(["condition", "tier", "scored", "TTFT ms: warm, first use", "TPOT ms", "ITL ms: p50, p90 / p99", "decode tokens/s",
                        "wall ms", "outside the calls ms (the wall)", "decode call ms: steady, once per episode"],
                       srows, cls="conditions")
    ratios = data.runtime_ratios(s)
    rrows = []
    for r in ratios:
        m, gi = r["median"], r["gate_interval"]
        mi = m["interval"]
        rrows.append([name_cell(r["condition"]), r["tier"], name_cell(r["control"]),
                      _passed(r["passed"]), _num(r["gate_value"], "{:.4g}"),
                      Markup(f'<td class="num">{esc("-" if not gi else f"[{gi[0]:.4g}, {gi[1]:.4g}]")}</td>'),
                      _num(m["value"], "{:.4g}"),
                      Markup(f'<td class="num">{esc(f"[{mi[0]:.4g}, {mi[1]:.4g}]")}</td>'),
                      Markup(f'<td class="wrap{" fail" if r["disagree"] else ""}">'
                             f'{esc(("disagree " + r["because"]) if r["disagree"] else ("agree; " + (r["outliers_text"] or "no outliers beyond 3 IQR")))}</td>')])
    rtable = (html_table(["condition", "tier", "control", "gate", "summed walls", "bootstrap interval", "ratio of medians",
                          "paired interval", "readings"], rrows, cls="conditions") if rrows
                  else '<p class="missing">no runtime readings: no condition pairs with the reference</p>')
    previous = data.steady_by_previous(s)
    ptable = html_table(["condition", "tier", "steady decode call ms by what ran before it in the worker (episodes)"],
                        [[name_cell(r["condition"]), r["tier"],
                          Markup(f'<td class="wrap">{esc(_previous_text(r["previous"]))}</td>')] for r in previous],
                        cls="conditions") if previous else (
        f'<p class="missing">no steady decode call to split: {esc(_no_steady(s))}</p>')
    check = data.plan_positions([s])
    position = (f'<p id="position" class="{"fail" if check["flagged"] else ""}">{esc(serving.position_text(check))}'
                f'; each episode\'s wall over its condition\'s median, against the {serving.NEIGHBOURS} plan '
                f'positions each side.</p>')
    blocks = [b for b in check["blocks"] if b["block"] != "warmup"]
    btable = ('<p class="detail">By block (each prompt and repetition\'s episodes), the median wall over its '
              'condition\'s median: ' + esc(", ".join(f"{b['block']}: {b['relative']:.2f}" for b in blocks)) + "</p>")
    return "".join([
        '<h2 id="serving">Serving figures (scored episodes)</h2>',
        '<p>TTFT: the prefill call, from its start to the first logit on the host (warm: the median scored '
        'episode\'s; below it the first use, the condition\'s first episode). TPOT: the rest of the episode '
        'over its decode calls. ITL: every decode call, pooled. Decode tokens/s: the median episode\'s. The '
        'steady decode call is the median of every decode call but the first; once per episode: the first '
        'decode call over it (a graph capture shows here). Medians over the scored episodes; the flag below a '
        'figure counts episodes beyond 3 IQR of the quartiles (docs/metrics.md).</p>', table,
        '<h3 id="ratios">Runtime ratio: the frozen gate beside the ratio of medians</h3>',
        '<p>The gate judges the ratio of summed walls on its bootstrap upper bound (frozen with the protocol); '
        'the ratio of medians over the same pairs, with its paired bootstrap interval, is not moved by one slow '
        'episode. Where the two disagree the outliers that explain it are named.</p>', rtable,
        '<h3 id="previous">What ran before</h3>',
        '<p>Each record names the condition its worker ran just before it. A condition whose steady decode call '
        'moves with what ran before is measured differently in different places (a library\'s state, a parked '
        'model, the allocator): the same condition should read the same after every other.</p>', ptable,
        '<h3 id="positions">Plan position</h3>', position, btable,
    ])


def expert_cache_section(s: ScreenData) -> str:
    """Expert caches and forecasts: each measured hit rate beside Belady's optimum for the same
    capacity on the episode's own routing (docs/metrics.md); empty for a screen without one."""
    rows = data.expert_cache_rows(s)
    if not rows:
        return ""

    def pct(v):
        return _num(None if v is None else 100 * v, "{:.1f}%")

    trows = [[name_cell(r["condition"]), r["tier"],
              r["cache"],
              pct(r["hit_rate"]), pct(r["belady_rate"]), pct(r["decode_hit_rate"]), pct(r["decode_belady_rate"]),
              pct(r["decode_ready_rate"]),
              _num(r["prefetched"], "{}"), _num(r["used"], "{}"), _num(r["wasted"], "{}"),
              _num(None if r["decode_bytes_per_token"] is None else r["decode_bytes_per_token"] / 1e6, "{:.4g}")]
             for r in rows]
    return ('<h2 id="expert-cache">Expert caches against Belady\'s optimum (scored episodes)</h2>'
            '<p>Hit rate: routed experts the cache held before the call, over routed experts. Belady: the most '
            'hits any cache of the same capacity could have had on the same routing, knowing the future. The '
            'gap between them is what a better policy could still win. A forecast\'s prefetched experts are used '
            'or wasted (moved for nothing), counted over every call, the prefill\'s included; ready: routed '
            'experts already on the device when the routing was known, by a hit or a used prefetch.</p>'
            + html_table(["condition", "tier", "cache", "hit rate", "Belady", "decode hit rate", "decode Belady",
                          "decode ready", "prefetched", "used", "wasted", "decode MB/token"], trows, cls="conditions"))


def _previous_text(rows: list[dict]) -> str:
    return "; ".join(f"after {p['condition']}: {_fmt(_ms(p['median']), '{:.4g}')} ({p['n']})" for p in rows)


def summary_section(s: ScreenData) -> str:
    summary = data.condition_summary(s)
    approximate = any(r["tier"] == "approximate" for r in summary)
    rows = [[name_cell(r["condition"]), r["tier"], _policy(r), _episodes(r),
             _mb(r["prefill_h2d_per_call"]), _mb(r["decode_h2d_per_call"]), _spread(r["wall_s_spread"], "{:.3g}"),
             _spread(r["decode_ms_spread"], "{:.3g}"), _mib(r["peak_sampled_bytes"]),
             _two(_fmt(r["energy_j_per_episode"], "{:.4g} J"), _fmt(r["energy_j_per_token"], "{:.4g} J / token")),
             *([_two(_fmt(r["fidelity_mean_kl_max"], "KL {:.4g}"), _fmt(r["fidelity_top1_min"], "top-1 {:.4g}"))]
               if approximate else [])] for r in summary]
    return ('<h2 id="conditions">Conditions (scored episodes)</h2>' + _sharing_notes(s)
            + html_table(["condition", "tier", "policy", "scored", "H2D / prefill call", "H2D / decode call",
                      "wall s: median, p10-p90", "decode ms/token: median, p10-p90", "peak sampled GPU",
                      "energy / episode, / token", *(["worst mean KL, top-1"] if approximate else [])],
                     rows, cls="conditions"))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def cost_section(s: ScreenData) -> str:
    """The measurement's own cost (core/passes.py): with separate passes, per condition the median
    recording-pass wall over the timing-pass wall; with passes together, a line saying the
    timings include the recording."""
    cost = data.measurement_cost(s)
    head = '<h2 id="cost">The measurement\'s own cost</h2>'
    if cost["passes"] == "together":
        what = ("the per-layer ledger and, on a GPU, the NVML memory and energy sampler" if cost["recording"]
                else "the NVML memory and energy sampler on a GPU (the per-layer ledger was off: recording false)")
        return head + (f'<p id="passes-together">Passes together: every timing on this page includes the in-call '
                       f'recording ({esc(what)}). A protocol with <code>passes: separate</code> (schema 7) times '
                       f'each episode with both off, then records it in a second pass.</p>')
    lede = ('<p id="passes-separate">Separate passes: each episode ran twice, timed with the ledger and the sampler '
            'off, then recorded with both on. Every time on this page is the timing pass\'s; every byte, memory and '
            'energy figure the recording pass\'s. The ratio is the median over scored episodes of the recording '
            'wall over the timing wall of the same episode.</p>')
    rows = [[name_cell(r["condition"]), _num(r["n"], "{}"),
             _num(r["timing_wall_s"], "{:.4g} s"), _num(r["recording_wall_s"], "{:.4g} s"),
             _num(r["ratio"], "{:.4f}"),
             _two(_fmt(_ms(r["timing_decode_s"]), "{:.4g} ms"), _fmt(_ms(r["recording_decode_s"]), "recording {:.4g} ms"))]
            for r in cost["conditions"]]
    if not rows:
        return head + lede + '<p class="missing">no finished scored episode carries both passes\' figures</p>'
    return head + lede + html_table(["condition", "scored", "timing wall (median)", "recording wall (median)",
                                     "recording / timing", "decode call: timing, recording (median)"], rows,
                                    cls="conditions")


def workload_caption(workload: dict | None) -> str | None:
    """The activity-by-layer caption, naming only the lines the figure draws: the profile's target
    (dashed) only for a synthetic checkpoint with a profile, real OPT's figures (dotted) only where
    docs/workloads.md has them for this shape and prefix."""
    if workload is None:
        return None
    drawn = [p for p in ("decode", "prefill") if workload.get(p)]
    text = f"Each layer's active fraction in {' and '.join(drawn)} calls (solid, measured)"
    text += ("; dashed, what the synthetic profile targets per token" if workload.get("target")
             else "; no profile target is drawn (not a synthetic checkpoint with a profile)")
    text += ("; dotted, real OPT's measured mean for this shape and prefix (docs/workloads.md)."
             if workload.get("anchors") else "; no real-OPT figure is drawn (docs/workloads.md has none for "
                                             "this shape and prefix).")
    return text + " `packbench model stats` gives every figure of a checkpoint."


def plots_section(s: ScreenData) -> str:
    c = s.conditions
    heat = data.active_heatmap(s)
    union = data.union_sparsity(s)
    workload = data.workload_by_layer(s)
    cpu = _gpu(s) == "CPU"
    intervals = data.runtime_intervals(s)
    paired = any(i["value"] is not None for i in intervals)  # as wall_figure draws its ratio panel
    return "".join([
        '<h2 id="transfer">Host-to-device bytes per call</h2>',
        plot_figure("h2d", figs.h2d_figure(data.h2d_per_call(s), c, s.protocol.reference),
              "no call ledgers with byte counts (recording off, or no finished scored episode)"),
        '<h2 id="runtime">Episode wall and the paired runtime interval</h2>',
        plot_figure("wall", figs.wall_figure(data.wall_per_episode(s), intervals, c),
              "no finished scored episode", caption=None if paired else (
                  "Wall time of every scored episode; no runtime ratio: no condition pairs with the control.")),
        '<h2 id="decode">Decode milliseconds per token</h2>',
        plot_figure("decode", figs.decode_figure(data.decode_ms_per_token(s), c), "no decode calls"),
        '<h2 id="memory">Sampled GPU memory against the allowance</h2>',
        plot_figure("memory", figs.memory_figure(data.memory_traces(s), c, s.protocol.allowance_bytes),
              "no GPU memory samples: " + ("a CPU run samples no GPU" if cpu else "the archive holds no traces/")),
        '<h2 id="activity">Active rows per layer</h2>',
        plot_figure("heatmap", figs.heatmap_figure(heat),
              "no condition observed active rows (dense-stream and resident do not; recording off records none)",
              caption=None if heat is None else PLOT_CAPTIONS["heatmap"] + f" Condition {heat['condition']}: the "
              "active set is the model's and the prompt's, identical under every exact policy."),
        '<h2 id="union">Union sparsity</h2>',
        plot_figure("union", figs.union_figure(union), "no observed activity, or the neurons per layer are unknown"),
        # an MoE model's activity is routed experts: no OPT profile or real-OPT figure to set it against
        '<h2 id="workload">Activity by layer' + ("" if data.unit_name(s) == "experts" else
                                                 ", against the profile and real OPT") + '</h2>',
        plot_figure("workload", figs.workload_figure(workload),
              "no condition observed active rows, or the neurons per layer are unknown",
              caption=workload_caption(workload)),
        '<h2 id="frontier">Frontier: decode time against memory, by tier</h2>',
        plot_figure("frontier", figs.frontier_figure(data.frontier(s), c), "no finished scored episode with decode calls"),
        '<h2 id="energy">Energy</h2>',
        plot_figure("energy", figs.energy_figure(data.energy(s), c),
              "no energy readings: " + ("NVML has no GPU to read on a CPU run" if cpu
                                        else "the episodes carry no energy_j")),
    ])


def audit_section(s: ScreenData, audit: AuditStatus) -> str:
    members = len(s.manifest.get("members", {}))
    intact = (f"intact: {members} members match the manifest" if s.complete and not s.problems
              else f"{len(s.problems)} problems")
    parts = ['<h2 id="audit">Archive and audit</h2>',
             html_facts([("archive", _mono(s.path)), ("file SHA-256", _mono(s.archive_sha256)),
                     ("size", f"{s.archive_bytes:,} B"),
                     ("episodes recorded", f"{len(s.episodes)} of {s.planned} planned"),
                     ("manifest check (now)", intact)])]
    if s.problems:
        parts.append('<ul class="problems">' + "".join(f"<li>{esc(p)}</li>" for p in s.problems[:20]) + "</ul>")
    if audit.source is None:
        parts.append('<p class="missing">audit status: no database given (pass --db, or a screen id); '
                     f'audit this file with <code>packbench audit --archive {esc(s.path)}</code></p>')
    elif not audit.rows:
        parts.append(f'<p class="missing">never audited in {esc(audit.source)}; run <code>packbench audit</code></p>')
    else:
        parts.append(f"<h3>Audits recorded in {esc(audit.source)}</h3>" + html_table(
            ["result", "where", "started", "finished", "digest", "problems"],
            [[_audit_cell(r["result"]), r["machine"],
              r["started"], r["finished"], Markup(f'<td class="mono">{esc(r["digest"])}</td>'), str(r["problems"])]
             for r in audit.rows]))
        digests = {r["digest"] for r in audit.rows}
        if len(audit.rows) > 1:
            same = "one digest: repeat audits agree" if len(digests) == 1 else f"{len(digests)} different digests"
            parts.append(f"<p>{len(audit.rows)} audits, {same}.</p>")
    if audit.note:
        parts.append(f'<p class="fail">{esc(audit.note)}</p>')
    return "".join(parts)


# ----------------------------------------------------------------------------- pages


def html_page(title: str, lede: str, body: str, *, plural: str = "") -> str:
    import matplotlib

    try:
        version = metadata.version("packbench")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    return PAGE.substitute(title=esc(title), lede=esc(lede), body=body, css=CSS, version=esc(version),
                           mpl=esc(matplotlib.__version__), plural=plural)


def screen_page(s: ScreenData, *, audit: AuditStatus) -> str:
    passed = sum(bool(v["passed"]) for v in s.verdicts)
    batch = f", batch {s.protocol.batch}" if s.protocol.batch > 1 else ""
    lede = (f"{data.model_label(s)}, {s.protocol.dtype}{batch}; {len(s.episodes)} of {s.planned} episodes; "
            f"{passed} of {len(s.verdicts)} verdicts pass; {_gpu(s)}")
    with figs.style():
        plots = plots_section(s)
    body = "".join([headline_section(s), failure_section(s, audit), verdict_section(s), summary_section(s),
                    serving_section(s),
                    expert_cache_section(s), cost_section(s),
                    plots, protocol_section(s),
                    machine_section(s), audit_section(s, audit)])
    return html_page(f"packbench report: {s.label}", lede, body)


def _wall_ranges(s: ScreenData) -> dict[str, tuple[float, float] | None]:
    """condition -> (p10, p90) of the scored episodes' walls (core/dispersion.py)."""
    out = {}
    for c, walls in data.wall_per_episode(s).items():
        sp = spread([w for _, w in walls])
        out[c] = None if sp["n"] == 0 else (sp["p10"], sp["p90"])
    return out


def _compare_sharing(labels: list[str], screens: list[ScreenData]) -> str:
    """Whether each screen's host or GPU was shared while its episodes ran (times then may be
    inflated), in one paragraph above the wall figure."""
    notes = []
    for label, s in zip(labels, screens):
        host, gpu = data.host_sharing(s), data.gpu_sharing(s)
        if host["episodes"]:
            notes.append(f"screen {label}'s host was shared with other packbench workers in "
                         f"{len(host['episodes'])} of {len(s.episodes)} episodes")
        if gpu["episodes"]:
            notes.append(f"screen {label}'s GPU was shared with other processes in {len(gpu['episodes'])} of "
                         f"{len(s.episodes)} episodes")
        noisy = noisy_host(e.record for e in s.episodes)
        if noisy["episodes"]:
            notes.append(f"screen {label}'s host was busy with other processes (>= {noisy['threshold']:g} core) "
                         f"in {len(noisy['episodes'])} of {len(s.episodes)} episodes")
    if not notes:
        return ('<p id="compare-shared">No screen\'s host or GPU was seen shared with another packbench worker or '
                'GPU process, or its host busy with other processes, while its episodes ran.</p>')
    return f'<p class="fail" id="compare-shared">{esc("; ".join(notes))}: their walls may be inflated.</p>'


def compare_page(screens: list[ScreenData], audits: list[AuditStatus]) -> str:
    labels = [f"{chr(65 + n)}" for n in range(len(screens))]
    agreement = data.verdict_agreement(screens)
    conditions = list(dict.fromkeys(c for s in screens for c in s.conditions))
    ident = html_table(["", "screen", "protocol", "batch", "frozen SHA-256", "machine", "GPU", "torch",
                        "archive SHA-256", "audits"],
                       [[labels[n], Markup(f'<td class="wrap" style="overflow-wrap: anywhere">{esc(s.label)}</td>'), s.protocol.name,
                         _num(s.protocol.batch, "{}"),
                         Markup(f'<td class="mono">{esc(s.protocol.sha256[:16])}</td>'),
                         s.environment.get("host"), Markup(f'<td class="wrap">{esc(_gpu(s))}</td>'), s.environment.get("torch"),
                         Markup(f'<td class="mono">{esc(s.archive_sha256[:16])}</td>'),
                         "-" if a.source is None else (", ".join(r["result"] for r in a.rows) or "none")]
                        for n, (s, a) in enumerate(zip(screens, audits))])
    judged, agree = agreement["judged_by_all"], agreement["agree"]
    what = "the same frozen protocol" if agreement["same_protocol"] else "different protocols"
    head = (f'<h2 id="agreement">Verdict agreement: {agree} of {judged} verdicts judged by every screen agree</h2>'
            f"<p>The screens ran {what}; a verdict any screen lacks is shown as -.</p>")
    vrows = [[r["gate"], name_cell(r["condition"]), r["phase"], *[_passed(p) for p in r["passed"]],
              (Markup('<td class="pass">agree</td>') if r["agree"] else Markup('<td class="fail">differ</td>')) if r["all_judged"]
              else Markup('<td class="none">not judged by all</td>')] for r in agreement["rows"]]
    vtable = html_table(["gate", "condition", "phase", *labels, "agreement"], vrows)
    summaries = [{r["condition"]: r for r in data.condition_summary(s)} for s in screens]
    srows = []
    for c in conditions:
        for n, summ in enumerate(summaries):
            r = summ.get(c)
            if r is None:
                continue
            srows.append([name_cell(c), labels[n], _episodes(r), _mb(r["prefill_h2d_per_call"]),
                          _mb(r["decode_h2d_per_call"]), _num(r["wall_s_mean"], "{:.4g} s"),
                          _spread(r["wall_s_spread"], "{:.3g}"), _spread(r["decode_ms_spread"], "{:.3g}"),
                          _mib(r["peak_sampled_bytes"]), _num(r["energy_j_per_token"], "{:.4g} J")])
    stable = html_table(["condition", "screen", "scored", "H2D / prefill call", "H2D / decode call", "mean wall",
                         "wall s: median, p10-p90", "decode ms/token: median, p10-p90", "peak sampled GPU",
                         "energy / token"], srows, cls="conditions")
    ratio_rows = []
    for n, s in enumerate(screens):
        for r in data.runtime_ratios(s):
            gi, mi = r["gate_interval"], r["median"]["interval"]
            ratio_rows.append([name_cell(r["condition"]), labels[n], name_cell(r["control"]), _num(r["gate_value"], "{:.4g}"),
                               Markup(f'<td class="num">{esc("-" if not gi else f"[{gi[0]:.4g}, {gi[1]:.4g}]")}</td>'),
                               _num(r["threshold"], "{!r}"), r["source"], _num(r["median"]["value"], "{:.4g}"),
                               Markup(f'<td class="num">{esc(f"[{mi[0]:.4g}, {mi[1]:.4g}]")}</td>'),
                               Markup(f'<td class="wrap{" fail" if r["disagree"] else ""}">'
                                      f'{esc(("disagree " + r["because"]) if r["disagree"] else "agree")}</td>')])
    rtable = (html_table(["condition", "screen", "control", "summed walls", "interval", "gate threshold", "from",
                          "ratio of medians", "paired interval", "readings"], ratio_rows, cls="conditions") if ratio_rows
              else '<p class="missing">no runtime readings: no condition pairs with its screen\'s reference</p>')
    serving_rows = []
    for c in conditions:
        for n, s in enumerate(screens):
            r = next((x for x in data.serving_rows(s) if x["condition"] == c), None)
            if r is None or not r["episodes"]:
                continue
            serving_rows.append([name_cell(c), labels[n], r["tier"],
                                 _ms_cell(r["ttft_s"], r["outliers"]["ttft_s"], first=r["ttft_first_s"]),
                                 _ms_cell(r["tpot_s"], r["outliers"]["tpot_s"]),
                                 _two(_fmt(_ms(r["itl_p50_s"]), "{:.4g}"), _fmt(_ms(r["itl_p99_s"]), "p99 {:.4g}")),
                                 _num(r["decode_tokens_per_s"], "{:,.4g}"), _ms_cell(r["wall_s"], r["outliers"]["wall_s"]),
                                 _two(_fmt(_ms(r["steady_call_s"]), "{:.4g}"), _once(r), wrap=True)])
    stable_serving = html_table(["condition", "screen", "tier", "TTFT ms: warm, first use", "TPOT ms", "ITL ms: p50, p99",
                                 "decode tokens/s", "wall ms", "decode call ms: steady, once per episode"],
                                serving_rows, cls="conditions")
    with figs.style():
        plots = "".join([
            '<h2 id="decode">Decode milliseconds per token</h2>',
            plot_figure("compare-decode", figs.compare_decode_figure(labels, [data.decode_ms_per_token(s) for s in screens],
                                                               conditions), "no decode calls",
                  caption="Decode ms per generated token per condition, one box per screen (A, B, ...)."),
            '<h2 id="transfer">Host-to-device bytes per decode call</h2>',
            plot_figure("compare-h2d", figs.compare_bars_figure(
                "compare-h2d", labels, [{c: r["decode_h2d_per_call"] for c, r in summ.items()} for summ in summaries],
                conditions, "mean H2D MB per decode call", scale=1e6), "no byte counts",
                caption="Mean host-to-device bytes per decode call per condition, one bar per screen."),
            '<h2 id="wall">Mean episode wall</h2>', _compare_sharing(labels, screens),
            plot_figure("compare-wall", figs.compare_bars_figure(
                "compare-wall", labels, [{c: r["wall_s_mean"] for c, r in summ.items()} for summ in summaries],
                conditions, "mean wall s per scored episode", ranges=[_wall_ranges(s) for s in screens]),
                "no finished episodes",
                caption="Mean wall seconds of the scored episodes per condition, one bar per screen; error bars "
                        "span the 10th to the 90th percentile of those episodes' walls."),
            ])
    body = "".join([
        '<h2 id="screens">Screens</h2>', ident, head, vtable,
        '<h2 id="conditions">Conditions side by side</h2>', stable,
        '<h3 id="serving">Serving figures (docs/metrics.md)</h3>', stable_serving,
        '<h3>Paired runtime ratios: the gate\'s summed walls beside the ratio of medians</h3>', rtable,
        "".join(f'<p class="{"fail" if c["unexplained"] else ""}">Screen {labels[n]}: {esc(serving.position_text(c))}</p>'
                for n, c in enumerate(data.plan_positions([s]) for s in screens)), plots,
        *[f'<h2 id="audit-{labels[n]}">Screen {labels[n]}: archive and audit</h2>' + audit_section(s, a)
          .replace('<h2 id="audit">Archive and audit</h2>', "") for n, (s, a) in enumerate(zip(screens, audits))],
    ])
    lede = f"{len(screens)} screens of {what}: " + "; ".join(f"{labels[n]} = {s.label}" for n, s in enumerate(screens))
    return html_page("packbench comparison", lede, body, plural="s")
