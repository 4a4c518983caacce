"""The sweep page: each condition's decode ms/token, bytes per token and verdicts against the
swept field, in the report's style (cli/report_figures.py, cli/report_page.py)."""

from __future__ import annotations

from typing import Any

from packbench.cli import report_figures as figs
from packbench.cli.report_page import html_facts, html_page, html_table, name_cell, plot_figure

FIGURES = {"decode_ms_per_token": "decode ms per token (median over the scored ok episodes; bars: min-max)",
           "bytes_per_token": "host-to-device bytes per generated token (scored ok episodes)"}
# Axis titles: the caption's long one ran past the top of the bytes plot's axis.
YLABELS = {"decode_ms_per_token": "decode ms per token", "bytes_per_token": "H2D bytes per token"}


def axis(points: list) -> tuple[list[float], list[str], str]:
    """x positions, tick labels and the axis title: the swept field's own values when one numeric
    field was swept, else the points in grid order labelled with their values."""
    fields = list(points[0].values) if points else []
    values = [p.values.get(fields[0]) for p in points] if len(fields) == 1 else []
    numeric = values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric:
        return [float(v) for v in values], [str(v) for v in values], fields[0]
    labels = [figs.plain("\n".join(f"{k}={v}" for k, v in p.values.items())) for p in points]
    return [float(i) for i in range(len(points))], labels, figs.plain(", ".join(fields)) or "point"


def figure(points: list, key: str) -> str | None:
    xs, labels, title = axis(points)
    conditions = sorted({c for p in points for c in p.figures})
    fig, ax = figs._figure(7.5, 3.2)
    drawn = False
    for n, c in enumerate(conditions):
        pts = [(x, p.figures[c][key]) for x, p in zip(xs, points) if p.figures.get(c, {}).get(key) is not None]
        if pts:
            drawn = True
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=figs.colour(n), label=figs.short(c))
            _range_bars(ax, [p.figures.get(c, {}) for p in points], xs, key, figs.colour(n))
    if not drawn:
        return None
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_xlabel(title)
    ax.set_ylabel(YLABELS[key])
    medians = [[p.figures.get(c, {}).get(key) for p in points] for c in conditions]
    tops = [p.figures.get(c, {}).get(f"{key}_max") for p in points for c in conditions]
    if figs.wants_log(*([v for v in m if v is not None] for m in medians), [v for v in tops if v is not None]):
        ax.set_yscale("log")  # a 22.7 ms first decode drew every median as a line along 0
        figs.plain_log_ticks(ax.yaxis)
        ax.set_ylabel(YLABELS[key] + " (log scale)")
    if key == "bytes_per_token":  # whole bytes, written out: no 1e5 offset above the axis
        from matplotlib.ticker import FuncFormatter

        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.legend(loc="best")
    return figs.to_svg(fig, f"sweep-{key}")


def _range_bars(ax, figures: list[dict], xs: list[float], key: str, colour: str) -> None:
    """Each point's min-max over its episodes, where the figure has one (decode ms per token)."""
    spans = [(x, f.get(key), f.get(f"{key}_min"), f.get(f"{key}_max")) for x, f in zip(xs, figures)]
    spans = [s for s in spans if None not in s]
    if spans:
        ax.errorbar([s[0] for s in spans], [s[1] for s in spans], fmt="none", ecolor=colour, alpha=0.5, capsize=3,
                    yerr=[[s[1] - s[2] for s in spans], [s[3] - s[1] for s in spans]])


def verdict_figure(points: list) -> str | None:
    """One row per (condition, gate, phase), one column per point: a filled circle passed, a cross failed."""
    xs, labels, title = axis(points)
    rows = sorted({(v["condition"], v["gate"], v["phase"]) for p in points for v in p.verdicts})
    if not rows:
        return None
    fig, ax = figs._figure(7.5, 0.6 + 0.35 * len(rows))
    for y, row in enumerate(rows):
        for x, p in zip(xs, points):
            v = next((v for v in p.verdicts if (v["condition"], v["gate"], v["phase"]) == row), None)
            if v is not None:
                ax.plot([x], [y], marker="o" if v["passed"] else "x", ms=9, linestyle="none",
                        color="#2ca02c" if v["passed"] else "#d62728")
    ax.set_yticks(range(len(rows)), [f"{figs.short(c)} {g}" + ("" if ph == "all" else f" {ph}") for c, g, ph in rows], fontsize=8)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_xlabel(title)
    ax.set_ylim(-0.5, len(rows) - 0.5)
    return figs.to_svg(fig, "sweep-verdicts")


def sweep_page(sweep_id: str, points: list) -> str:
    with figs.style():
        plots = [plot_figure(key, figure(points, key), f"no {key} yet", FIGURES[key] + " against the swept field.")
                 for key in FIGURES]
        plots.append(plot_figure("verdicts", verdict_figure(points), "no verdicts yet",
                                 "Each verdict of each point: a green circle passed, a red cross failed."))
    # One row per point and condition: a column per condition and figure ran past the page.
    head = ["screen", "point", "status", "protocol", "condition", "decode ms/token: median [min-max]",
            "H2D bytes per token"]
    rows = [[str(p.screen_id), ", ".join(f"{k}={v}" for k, v in p.values.items()), p.status, p.protocol_sha256[:12],
             name_cell(c), _decode_cell(p.figures.get(c, {})), _fmt(p.figures.get(c, {}).get("bytes_per_token"), "{:,.0f}")]
            for p in points for c in (_conditions([p]) or ["-"])]
    facts = html_facts([("sweep", sweep_id), ("points", len(points)),
                        ("fields", ", ".join(points[0].values) if points else "-")])
    body = (f"<section><h2>Sweep</h2>{facts}{html_table(head, rows)}</section>"
            f"<section><h2>Figures</h2>{''.join(plots)}</section>")
    return html_page(f"packbench sweep {sweep_id}", f"{len(points)} screens, one per point", body, plural="s")


def _conditions(points: list) -> list[str]:
    return sorted({c for p in points for c in p.figures})


def _fmt(v: Any, fmt: str = "{:,.4g}") -> str:
    return "-" if v is None else fmt.format(v)


def _decode_cell(f: dict) -> str:
    median, lo, hi = (f.get(f"decode_ms_per_token{s}") for s in ("", "_min", "_max"))
    if median is None:
        return "-"
    return f"{median:.4g}" + ("" if lo is None or hi is None else f" [{lo:.4g}-{hi:.4g}]")
