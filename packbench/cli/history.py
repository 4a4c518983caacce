"""`packbench history PROTOCOL`: a protocol's figures across code versions, with steps and a CI gate.

Thin: service/history.py orders the screens, computes each figure and finds the steps (its
docstring states the method and its measured false-alarm rate); this module prints the table,
JSON or an HTML page with one plot per figure, in the report's style (cli/report_figures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from packbench.cli.common import DbUrl, open_store, write_output
from packbench.core.errors import PackbenchError

FailAbove = Annotated[Optional[float], typer.Option(
    "--fail-above", help="Exit 1 when a timed figure got slower by more than PCT percent (a step, or the newest "
                         "run beyond the bound), or any exact counter changed.", metavar="PCT")]


def register(app: typer.Typer) -> None:
    app.command("history")(history_cmd)


def check_fail_above(pct: float | None, *, protocol: str | None = None) -> None:
    """--fail-above is a percentage >= 0 (NaN refused), and `compare` judges two screens with it."""
    if pct is not None and not pct >= 0:
        raise PackbenchError(f"--fail-above {pct} must be a percentage >= 0, e.g. --fail-above 10")
    if pct is not None and protocol is not None:
        raise PackbenchError("--fail-above judges B against A; give two screen ids instead of --protocol")


def judge(regressions: list[str], pct: float) -> None:
    """The --fail-above judgement on stderr: one `regression:` line each, then exit 1; or one
    `no regression` line, so a CI log that exits 0 says what was judged."""
    for line in regressions:
        typer.echo(f"regression: {line}", err=True)
    if regressions:
        raise typer.Exit(1)
    typer.echo(f"no regression: nothing slower by more than {pct:g}% and no exact counter changed", err=True)


def fail_compare(store, screen_a: int, screen_b: int, pct: float) -> None:
    """`compare A B --fail-above PCT`: one `regression:` line each on stderr, then exit 1 (`judge`)."""
    from packbench.service.history import compare_regressions

    regressions = compare_regressions(store, screen_a, screen_b, pct)
    judge(regressions, pct)


def history_cmd(
    protocol: Annotated[str, typer.Argument(help="Protocol name or SHA-256 prefix.")],
    condition: Annotated[Optional[str], typer.Option(help="Only this condition.")] = None,
    metric: Annotated[Optional[str], typer.Option(
        help="Only this figure: wall_ms, call_ms, decode_ms_per_token (timed); h2d_bytes, d2h_bytes, rows, tokens "
             "(exact).")] = None,
    fail_above: FailAbove = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Write an HTML page with one plot per figure.")] = None,
    db: DbUrl = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print the history as one JSON object.")] = False,
) -> None:
    """A protocol's screens in order of their source commit (then date): each figure's median and
    spread per commit, the steps found, and with --fail-above an exit code for CI.

    Exit codes: 0 no regression beyond --fail-above (or no --fail-above); 1 one was found; 2 bad input.
    """
    from packbench.cli.summary import table
    from packbench.service import history as hist

    check_fail_above(fail_above)
    if html is not None and html.suffix.lower() not in (".html", ".htm"):
        raise PackbenchError(f"--html {html}: write the page to a .html file")
    h = hist.history(open_store(db), protocol, condition=condition, metric=metric)
    regressions = h.regressions(fail_above) if fail_above is not None else []
    if html is not None:
        write_output(html, history_page(h), "--html")
    if json_out:
        typer.echo(json.dumps({**hist.as_json(h), "regressions": regressions}, sort_keys=True, default=str))
    else:
        rows = hist.by_commit(h)
        typer.echo(f"{h.protocol}: {len(h.points)} screens over {len(rows)} commits (median [min-max] of the "
                   f"screens' medians; STEP: a confirmed change beyond {hist.K:g} spreads, CHANGED: an exact "
                   f"counter moved)")
        for title, columns, condition_rows in by_condition(rows):
            typer.echo(f"\n{titled(title, h.tiers)}")
            typer.echo(table(condition_rows, columns))
        for s in h.series:
            for st in s.steps:
                p = h.points[st.index]
                typer.echo(f"step: {s.condition} {s.metric} {st.change_pct:+.1f}% at screen {p.screen_id} (commit "
                           f"{p.commit[:10] or '?'}): {st.before:.4g} -> {st.value:.4g}"
                           f"{'' if st.confirmed else ' (newest run, unconfirmed)'}")
        typer.echo(_far_line(h.far))
        if html is not None:
            typer.echo(f"wrote {html} ({html.stat().st_size:,} bytes)")
    if fail_above is not None:
        judge(regressions, fail_above)


def by_condition(rows: list[dict]) -> list[tuple[str, list[str], list[dict]]]:
    """The per-commit rows as one table per condition: (condition, columns, rows), the columns
    the commit's and that condition's figures named by metric alone. One table of every
    condition's figures ran to 330 characters a line."""
    fixed = [k for k in rows[0] if ":" not in k]
    conditions = list(dict.fromkeys(k.split(":", 1)[0] for k in rows[0] if ":" in k))
    out = []
    for c in conditions:
        keys = [k for k in rows[0] if k.startswith(f"{c}:")]
        metric_rows = [{**{k: r[k] for k in fixed}, **{k.split(":", 1)[1]: r[k] for k in keys}} for r in rows]
        out.append((c, [*fixed, *(k.split(":", 1)[1] for k in keys)], metric_rows))
    return out


def titled(condition: str, tiers: dict[str, str]) -> str:
    """A condition's heading with its tier, as `results` and `compare` label every row."""
    return f"{condition} ({tiers[condition]})" if condition in tiers else condition


def _far_line(far: dict | None) -> str:
    from packbench.service import history as hist

    if far is None:
        return (f"false-alarm rate: not measured here (it needs {hist.MIN_BEFORE + 2} runs of one commit); on "
                f"log-normal noise it is below 1% of 12-run sequences (service/history.py)")
    return (f"false-alarm rate on {far['shuffles']} shuffles of commit {far['commit'][:10] or '?'}'s {far['runs']} "
            f"runs: {far['rate']:.2%} of orderings ({far['series']} timed series)")


PLOT_UNITS = {"wall_ms": "ms per episode", "call_ms": "ms of forward calls per episode",
              "decode_ms_per_token": "decode ms per token", "h2d_bytes": "bytes host-to-device",
              "d2h_bytes": "bytes device-to-host", "rows": "episode rows"}


def history_page(h) -> str:
    """The whole HTML page: the per-commit table and one static SVG plot per figure."""
    from packbench.cli import report_figures as figs
    from packbench.cli.report_page import Markup, html_facts, html_page, plot_figure, html_table, esc
    from packbench.service import history as hist

    rows = hist.by_commit(h)
    metrics = list(dict.fromkeys(s.metric for s in h.series))
    plots = []
    with figs.style():
        for m in metrics:
            if m == "tokens":
                continue  # a digest: the table says whether it changed
            svg = _metric_figure(h, m)
            caption = (f"{PLOT_UNITS.get(m, m)} of each screen in history order (the median over its scored ok "
                       f"episodes; bars: min-max); dashed lines divide commits; red triangles mark steps."
                       if m in hist.TIMED else
                       f"{PLOT_UNITS.get(m, m)} of each screen (exact: any change is flagged).")
            plots.append(plot_figure(m, svg, f"no values of {m}", caption))
    facts = html_facts([("protocol", h.protocol), ("screens", len(h.points)), ("commits", len(rows)),
                        ("method", Markup(esc(f"a change beyond {hist.K:g} spreads of the {hist.MIN_BEFORE}-"
                                              f"{hist.WINDOW} runs before it, confirmed by the run after"))),
                        ("false alarms", _far_line(h.far))])
    body = (f"<section><h2>History</h2>{facts}{_condition_tables(rows, html_table, esc, h.tiers)}</section>"
            f"<section><h2>Figures</h2>{''.join(plots)}</section>")
    lede = f"{len(h.points)} screens of {h.protocol} over {len(rows)} commits"
    return html_page(f"packbench history: {h.protocol}", lede, body, plural="s")


def _condition_tables(rows: list[dict], table, esc, tiers: dict[str, str]) -> str:
    """The per-commit table, one per condition (commit, screens, first run, that condition's
    figures): one table of every condition's figures ran three columns past the page."""
    fixed = [k for k in rows[0] if ":" not in k]
    conditions = list(dict.fromkeys(k.split(":", 1)[0] for k in rows[0] if ":" in k))
    out = []
    for c in conditions:
        keys = [k for k in rows[0] if k.startswith(f"{c}:")]
        # A timed cell wraps between its median and its range: seven figures on one line each
        # ran past the page; the first run reads to the minute (its date and time).
        body = [[*(_fixed_cell(k, r[k], esc) for k in fixed),
                 *(_figure_cell(r[k], esc) for k in keys)] for r in rows]
        out.append(f"<h3>{esc(titled(c, tiers))}</h3>" + table([*fixed, *(k.split(":", 1)[1] for k in keys)], body, cls="conditions"))
    return "".join(out)


def _figure_cell(value, esc) -> str:
    """`median [min-max] STEP` as the median over its range (and mark): one figure per line."""
    import re

    from packbench.cli.report_page import Markup

    m = re.fullmatch(r"(\S+) (\[[^\]]*\])(.*)", value or "")
    if m is None:
        return Markup(f"<td>{esc('-' if value is None else value)}</td>")
    mark = f' <span class="fail">{esc(m.group(3).strip())}</span>' if m.group(3).strip() else ""
    return Markup(f'<td>{esc(m.group(1))}{mark}<br><span class="detail">{esc(m.group(2))}</span></td>')


def _fixed_cell(key: str, value, esc) -> str:
    from packbench.cli.report_page import Markup

    if key == "first_run" and isinstance(value, str) and "T" in value:
        return Markup(f'<td title="{esc(value)}">{esc(value[:16].replace("T", " "))}</td>')
    return Markup(f'<td class="wrap">{esc(value)}</td>') if key == "screens" else Markup(f"<td>{esc(value)}</td>")


MAX_TICK_LABELS = 16  # screen/commit labels under a history plot; past this, every k-th one


def _metric_figure(h, metric: str) -> str | None:
    from packbench.cli import report_figures as figs
    from packbench.service import history as hist

    series = [s for s in h.series if s.metric == metric]
    if not any(v is not None for s in series for v in s.values):
        return None
    fig, ax = figs._figure(8.0, 3.2)
    xs = list(range(len(h.points)))
    for n, s in enumerate(series):
        pts = [(x, v) for x, v in zip(xs, s.values) if v is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, color=figs.colour(n),
                label=s.condition, drawstyle="default" if metric in hist.TIMED else "steps-mid")
        if metric in hist.TIMED:
            lo = [v - h.points[x].timed[s.condition][metric]["min"] for x, v in pts]
            hi = [h.points[x].timed[s.condition][metric]["max"] - v for x, v in pts]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[lo, hi], fmt="none",
                        ecolor=figs.colour(n), alpha=0.5)
            for st in s.steps:
                ax.plot([st.index], [st.value], marker="v", ms=10, color="#d62728", linestyle="none")
    prev = None
    for x, p in enumerate(h.points):
        if prev is not None and p.commit != prev:
            ax.axvline(x - 0.5, color="#7f7f7f", linestyle="--", linewidth=0.8)
        prev = p.commit
    every = -(-len(xs) // MAX_TICK_LABELS)  # 50 screens' two-line labels ran into each other
    ax.set_xticks(xs[::every], [figs.plain(f"{p.screen_id}\n{p.commit[:7] or '?'}") for p in h.points][::every],
                  fontsize=7)
    ax.set_xlabel("screen, commit")
    ax.set_ylabel(PLOT_UNITS.get(metric, metric))
    if metric not in hist.TIMED:  # whole counts: no 3.95 rows, and no "1e6" offset above the axis
        from matplotlib.ticker import FuncFormatter, MaxNLocator

        top = max(v for s in series for v in s.values if v is not None)
        # From (just below) 0: a flat count of 4 rows drew nine ticks all reading 4, and a count of 0
        # sat half hidden under the axis.
        ax.set_ylim(-0.04 * (top * 1.1 + 1), top * 1.1 + 1)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.legend(loc="best")
    return figs.to_svg(fig, f"history-{metric}")
