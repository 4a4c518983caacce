"""The report's plots: matplotlib figures written as static inline SVG.

Why static SVG: a report must open anywhere with no network, stay small and read well when
printed. An interactive bundle (plotly.js ~3.5 MB, vega ~0.8 MB) would outweigh the data of a
whole screen; matplotlib's SVG of a seed-v0.40-shaped screen is tens of kilobytes per plot,
text stays text (`svg.fonttype: none`), and the one dense picture, the active-row heat map,
is embedded as a PNG inside its SVG. Figures use the object API (`Figure`), never pyplot's
global state, and matplotlib is imported when a report is drawn, not at import time.

Each function takes derived series (core/report.py) and returns an SVG string, or None when
there is nothing to draw (the page then says why instead).
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np
from matplotlib.ticker import MaxNLocator

from packbench.core.protocol import MIB

MB = 1e6
# One colour per condition position, kept across every figure of a report (matplotlib's
# tab10, colour-blind-safe enough for up to ten conditions).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
RC = {"svg.fonttype": "none", "font.size": 10, "axes.titlesize": 11, "axes.spines.top": False,
      "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": 9,
      "legend.frameon": False, "font.family": "DejaVu Sans"}


def plain(text: str) -> str:
    """`text` drawn as written: matplotlib reads a pair of `$` as mathematics (a swept value
    `a$\\foo$` raised mid-drawing). Its own log ticks are mathematics, so parsing stays on."""
    return text.replace("$", r"\$")


def style():
    """The report's matplotlib settings, for the figures drawn inside it (rcParams are read
    when artists are made, so the whole drawing happens under this context)."""
    import matplotlib

    return matplotlib.rc_context(RC)


def colour(n: int) -> str:
    return PALETTE[n % len(PALETTE)]


def _figure(width: float, height: float, **subplots: Any):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(**subplots) if subplots else fig.subplots()
    return fig, axes


def to_svg(fig, name: str) -> str:
    """The figure as an inline <svg> element: no XML prolog, no fixed size (it scales to its
    container), ids salted by `name` so several plots share one page without clashes, and no
    date (the same data gives the same bytes)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name, "svg.id": name}):
        # dpi only sets the resolution of the embedded images (heat map, dense scatters).
        fig.savefig(buf, format="svg", dpi=144, metadata={"Date": None, "Creator": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    head_end = svg.index(">")
    head = re.sub(r'\s(width|height)="[^"]*"', "", svg[:head_end])
    head += f' class="chart" role="img" aria-label="{name}"'
    return head + svg[head_end:]


# Above this many points a scatter is drawn as one embedded image, not one SVG element per point:
# a screen of 100 episodes x 512 decode calls would otherwise write ~50,000 <use> elements (MBs).
MAX_VECTOR_POINTS = 400
# Memory traces are thinned to this many samples per episode for drawing, always keeping the
# largest sample (the one the resources gate judges): a 5 ms sampler over a long episode gives
# thousands, far more than a 1000-pixel-wide panel can show.
MAX_TRACE_POINTS = 600


def thin_trace(t: np.ndarray, n: int = MAX_TRACE_POINTS) -> np.ndarray:
    """At most about `n` rows of a (samples, 2) trace: evenly spaced ones plus the peak, in time order."""
    if len(t) <= n:
        return t
    keep = np.unique(np.concatenate([np.linspace(0, len(t) - 1, n).astype(int), [int(np.argmax(t[:, 1]))]]))
    return t[keep]


def _jitter(n: int, seed: int) -> np.ndarray:
    # Deterministic spread of strip-plot points: a report redrawn from one archive is identical.
    return (np.random.default_rng(seed).random(n) - 0.5) * 0.35


def _strip(ax, groups: list[list[float]], labels: list[str], *, scale: float = 1.0, box: bool = True) -> None:
    """Points of each group at x = its position, with a box (quartiles, whiskers 1.5 IQR)."""
    for n, values in enumerate(groups):
        if not values:
            continue
        v = np.asarray(values, dtype=np.float64) / scale
        ax.scatter(n + _jitter(len(v), n), v, s=18, color=colour(n), alpha=0.7, linewidths=0, zorder=3,
                   rasterized=len(v) > MAX_VECTOR_POINTS)
        if box and len(v) > 1:
            ax.boxplot([v], positions=[n], widths=0.55, showfliers=False, patch_artist=False,
                       medianprops={"color": "black"}, whiskerprops={"color": "0.4"}, capprops={"color": "0.4"},
                       boxprops={"color": "0.4"})
    condition_ticks(ax, labels)
    ax.set_xlim(-0.6, len(labels) - 0.4)


NAME_CHARS = 24  # a condition's name drawn in a figure; the tables beside it write it whole


def short(name: str) -> str:
    """A condition's name cut in the middle to NAME_CHARS: a 200-character name (the most a
    protocol allows) pushed a panel's axes to nothing and ran across the panel beside it. Both
    ends stay, so `extents` and `extents-2` still read apart."""
    if len(name) <= NAME_CHARS:
        return name
    half = (NAME_CHARS - 1) // 2
    return name[:half] + "\u2026" + name[-half:]


def text_inches(text: str) -> float:
    """How wide `text` is drawn as a tick label, in inches (the report's font and size)."""
    import matplotlib
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    prop = FontProperties(family=matplotlib.rcParams["font.family"], size=matplotlib.rcParams["xtick.labelsize"])
    return TextPath((0, 0), text, prop=prop).get_extents().width / 72 if text else 0.0


def condition_ticks(ax, labels: list[str]) -> None:
    """Condition names under their positions, slanted when there are many (eight conditions'
    labels overlapped at 15 degrees in a half-width panel) or when two neighbours would touch
    level (three 60-character names, cut to 24, ran into each other under a half-width panel)."""
    slot = ax.figure.get_figwidth() * ax.get_position().width / max(len(labels), 1)  # inches a condition
    widths = [text_inches(short(label)) for label in labels]
    touch = any((a + b) / 2 > 0.95 * slot for a, b in zip(widths, widths[1:]))
    many = len(labels) > 5 or touch
    ax.set_xticks(range(len(labels)), [short(label) for label in labels], rotation=35 if many else 0, ha="right" if many else "center",
                  rotation_mode="anchor")


# ----------------------------------------------------------------------------- one screen


def h2d_figure(per_call: dict[str, dict[str, list[int]]], conditions: tuple[str, ...], reference: str) -> str | None:
    """Per-call H2D bytes (weights + indices) per condition, prefill and decode apart."""
    if not any(v for c in per_call.values() for v in c.values()):
        return None
    fig, axes = _figure(10, 3.9, ncols=2)
    for ax, phase in zip(axes, ("prefill", "decode")):
        groups = [per_call[c][phase] for c in conditions]
        ref = np.mean(per_call[reference][phase]) if per_call.get(reference, {}).get(phase) else None
        _strip(ax, groups, list(conditions), scale=MB, box=False)
        for n, values in enumerate(groups):
            if not values:
                continue
            mean = float(np.mean(values))
            ax.hlines(mean / MB, n - 0.3, n + 0.3, color=colour(n), lw=2)
            # The share of the reference's mean sits above the bar, not under the axis: eight
            # conditions' two-line tick labels ran into each other.
            share = f"\n{mean / ref:.1%}" if ref and conditions[n] != reference else ""
            # Nine conditions in a half-width panel: 4-digit labels at 8 pt touched their neighbours.
            many = len(conditions) > 5
            ax.annotate(f"{mean / MB:,.{3 if many else 4}g}{share}", (n, mean / MB), textcoords="offset points",
                        xytext=(0, 5), ha="center", fontsize=7 if many else 8)
        ax.set_title(f"{phase} calls (mean MB above each)")
        ax.set_ylabel("H2D MB per call (weights + indices)")
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.25)
    return to_svg(fig, "h2d")


def wall_figure(walls: dict[str, list[tuple[int, float]]], intervals: list[dict],
                conditions: tuple[str, ...]) -> str | None:
    """Wall seconds of every scored episode per condition; the paired runtime ratio against the
    control with its bootstrap interval (and the gate's threshold where one is declared)."""
    if not any(walls.values()):
        return None
    shown = [i for i in intervals if i["value"] is not None]
    # Without a pair (one condition, or none paired with the control) the ratio panel was an
    # empty axis titled "runtime ratio" over "wall / wall": the episode walls alone are drawn.
    fig, axes = _figure(10, 3.9, ncols=2, width_ratios=[3, 2]) if shown else _figure(10, 3.9)
    left, right = axes if shown else (axes, None)
    _strip(left, [[w for _, w in walls[c]] for c in conditions], list(conditions))
    left.set_ylabel("wall s per scored episode")
    left.set_title("episode wall")
    left.set_ylim(bottom=0)
    if not shown:
        return to_svg(fig, "wall")
    for y, i in enumerate(shown):
        n = conditions.index(i["condition"])
        lo, hi = i["interval"] or (i["value"], i["value"])
        right.errorbar([i["value"]], [y], xerr=[[i["value"] - lo], [hi - i["value"]]], fmt="o", color=colour(n),
                       capsize=4)
        if i["threshold"] is not None:
            right.vlines(i["threshold"], y - 0.35, y + 0.35, color="#d62728", lw=1.5, ls="--")
            right.annotate(f"threshold {i['threshold']:g}", (i["threshold"], y + 0.35), textcoords="offset points",
                           xytext=(0, 2), ha="center", fontsize=8, color="#d62728")
    right.axvline(1.0, color="0.5", lw=0.8, ls=":")
    right.set_yticks(range(len(shown)), [short(i["condition"]) for i in shown])
    right.set_ylim(-0.7, len(shown) - 0.3)
    # Two lines, the name cut as the ticks cut theirs: a 60-character control ran past the panel.
    right.set_xlabel(f"wall / {short(shown[0]['control'])} wall\n(paired; bootstrap interval)")
    right.set_title("runtime ratio: point and interval")
    return to_svg(fig, "wall")


def decode_figure(ms: dict[str, list[float]], conditions: tuple[str, ...]) -> str | None:
    """Distribution of decode milliseconds per token per condition."""
    if not any(ms.values()):
        return None
    fig, ax = _figure(10, 3.6)
    _strip(ax, [ms[c] for c in conditions], list(conditions))
    # Beside the box at the median's height (above the top point it read as an outlier's label);
    # past five conditions the labels ran into the next box: the conditions table has the medians.
    for n, c in enumerate(conditions if len(conditions) <= 5 else ()):
        if ms[c]:
            median = float(np.median(ms[c]))
            ax.annotate(f"median {median:.3g}", (n + 0.3, median), textcoords="offset points", xytext=(2, 0),
                        ha="left", va="center", fontsize=7)
    log = wants_log(*(ms[c] for c in conditions))
    if log:  # one slow call (a cold first decode), or one slow condition, flattens boxes on a linear axis
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    ax.set_ylabel("decode ms per token" + (" (log scale)" if log else ""))
    if not log:
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
    return to_svg(fig, "decode")


LOG_SPAN = 20.0  # a largest value this many times a median: on a linear axis that box is a line at 0


TIER_MARKERS = {"exact": "o", "approximate": "^"}


def frontier_figure(view: dict, conditions: tuple[str, ...]) -> str | None:
    """Decode ms per token against device memory, one point per condition: circles exact,
    triangles approximate (hollow when its fidelity gate failed), each approximate point
    labelled with its worst mean KL and top-1 agreement; an exact point's name is written
    beside it unless it would overlap another label (the legend names every point)."""
    points = [p for p in view["points"] if p["decode_ms"] is not None and p["memory_bytes"] is not None]
    if not points:
        return None
    fig, ax = _figure(10, 4.2)
    labels = []
    for p in points:
        n = conditions.index(p["condition"])
        hollow = p["tier"] == "approximate" and p["fidelity_passed"] is False
        ax.scatter([p["memory_bytes"] / MIB], [p["decode_ms"]], s=70, marker=TIER_MARKERS.get(p["tier"], "s"),
                   facecolors="none" if hollow else colour(n), edgecolors=colour(n), linewidths=1.5,
                   label=f"{short(p['condition'])} ({p['tier']})", zorder=3)
        text = short(p["condition"])
        if p["tier"] == "approximate" and p["fidelity_mean_kl_max"] is not None:
            verdict = {True: "PASS", False: "FAIL", None: "no gate"}[p["fidelity_passed"]]
            text += f"\nKL {p['fidelity_mean_kl_max']:.3g}, top-1 {p['fidelity_top1_min']:.3g}, fidelity {verdict}"
        labels.append((p["tier"] == "approximate", (p["memory_bytes"] / MIB, p["decode_ms"]), text))
    held = view["memory"] == "held"
    ax.set_xlabel("device memory held, MiB (no GPU sampled: parameters + policy buffers + KV cache)" if held
                  else "peak sampled GPU memory, MiB")
    ax.set_ylabel("median decode ms per token")
    ax.set_xlim(left=0, right=ax.get_xlim()[1] * 1.35)  # room for the labels of the rightmost points
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.15)
    for _, xy, text in kept_labels(ax, labels):
        ax.annotate(text, xy, textcoords="offset points", xytext=(6, 4), fontsize=7)
    ax.legend(loc="best")
    return to_svg(fig, "frontier")


LABEL_PT = 7  # the frontier's label size; a character is about 0.6 of it wide, a line 1.25 of it high


def kept_labels(ax, labels: list[tuple[bool, tuple[float, float], str]]) -> list:
    """The (must, xy, text) labels to draw: every `must` one (an approximate point's fidelity),
    then each other one whose box (estimated from its text, in display units once the limits are
    set) overlaps none already kept. Nine conditions within 0.1 MiB of one another wrote their
    names over each other."""
    scale = ax.figure.dpi / 72  # points -> pixels
    boxes, kept = [], []
    for must, xy, text in sorted(labels, key=lambda label: not label[0]):
        x, y = ax.transData.transform(xy)
        lines = text.split("\n")
        w = max(map(len, lines)) * 0.6 * LABEL_PT * scale
        h = len(lines) * 1.25 * LABEL_PT * scale
        box = (x + 6 * scale, y + 4 * scale, x + 6 * scale + w, y + 4 * scale + h)
        clash = any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes)
        if must or not clash:
            boxes.append(box)
            kept.append((must, xy, text))
    return kept


def wants_log(*groups: list[float]) -> bool:
    """A log axis when the largest positive value is LOG_SPAN times some group's median or more:
    one outlier flattens every box, and a condition 100x slower than another flattens the fast
    one's (on a busy 2-core host, dense-stream's decode median was 1.1 ms beside packet's 116)."""
    medians, top = [], 0.0
    for values in groups:
        v = np.asarray([x for x in values if x > 0], dtype=np.float64)
        if v.size:
            medians.append(float(np.median(v)))
            top = max(top, float(v.max()))
    return bool(medians) and top >= LOG_SPAN * min(medians)


def memory_figure(traces: dict[str, list[tuple[int, np.ndarray]]], conditions: tuple[str, ...],
                  allowance_bytes: int) -> str | None:
    """The sampled GPU memory of every episode, one panel per condition, against the allowance."""
    if not any(traces.values()):
        return None
    fig, axes = _figure(10, 3.4, ncols=len(conditions), sharey=True, squeeze=False)
    for n, (ax, c) in enumerate(zip(axes[0], conditions)):
        for k, (index, t) in enumerate(traces[c]):
            t = thin_trace(t)
            ax.plot(t[:, 0], t[:, 1] / MIB, color=colour(n), lw=1, alpha=0.4 + 0.6 / (k + 1),
                    label="one line per episode" if k < 1 else None)
        ax.axhline(allowance_bytes / MIB, color="#d62728", ls="--", lw=1, label="allowance")
        ax.set_title(short(c))
        ax.set_xlabel("s since episode start")
        if not traces[c]:
            ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", color="0.4")
    axes[0][0].set_ylabel("GPU MiB (sampled)")
    axes[0][0].set_ylim(bottom=0, top=allowance_bytes / MIB * 1.12)
    axes[0][0].legend(loc="lower right")
    return to_svg(fig, "memory")


def heatmap_figure(heat: dict | None) -> str | None:
    """Active rows per layer (y) over the scored calls (x) of one condition."""
    if heat is None or heat["rows"].size == 0:
        return None
    rows = heat["rows"]
    fig, ax = _figure(10, 3.1 + 0.03 * rows.shape[0])
    im = ax.imshow(np.ma.masked_invalid(rows), aspect="auto", origin="lower", interpolation="nearest", cmap="viridis",
                   vmin=0)  # scaled to the largest value seen: the structure, not the empty top, gets the colours
    for index, col in heat["episodes"][1:]:
        ax.axvline(col - 0.5, color="white", lw=0.8)
    ax.set_xticks([col for _, col in heat["episodes"]], [f"ep {i}" for i, _ in heat["episodes"]],
                  rotation=90 if len(heat["episodes"]) > 12 else 0, fontsize=7)
    ax.set_ylabel("layer")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"calls of the scored {short(heat['condition'])} episodes (first of each: prefill)")
    ax.grid(False)
    cb = fig.colorbar(im, ax=ax, pad=0.01)
    cb.set_label(f"active fraction of {heat['neurons']} {heat['unit']}" if heat["fraction"] else "active rows")
    return to_svg(fig, "heatmap")


def union_figure(union: dict | None) -> str | None:
    """Active fraction of neurons against tokens per call, with what independent firing would give."""
    if union is None or not union["points"]:
        return None
    fig, ax = _figure(10, 3.6)
    t = np.array([p[0] for p in union["points"]], dtype=np.float64)
    f = np.array([p[1] for p in union["points"]])
    ax.scatter(t * np.exp(_jitter(len(t), 1) * 0.2), f, s=12, alpha=0.5, color=colour(1), linewidths=0,
               label="calls (mean over layers)", rasterized=len(t) > MAX_VECTOR_POINTS)
    curve = np.array(union["curve"], dtype=np.float64)
    # A line only through three or more measured token counts: two points (prefill and decode)
    # joined read as a measured curve between them.
    ax.plot(curve[:, 0], curve[:, 1], union_style(len(curve)), color="black", lw=1.2, label="median per token count")
    one = [y for x, y in union["curve"] if x == 1]
    if one:  # what a union would be if neurons fired independently per token: 1 - (1 - a1)^T
        xs = np.unique(np.geomspace(1, max(2.0, float(t.max())), 50))
        ax.plot(xs, 1 - (1 - one[0]) ** xs, ls=":", color="0.4", label=f"independent tokens: 1-(1-{one[0]:.3f})^T")
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)  # token counts: 1, 2, 5, 10, not 10^0 and 2x10^0
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("tokens in the call")
    ax.set_ylabel(f"active fraction of {union['neurons']} {union['unit']}")
    ax.set_title(f"union sparsity ({short(union['condition'])})")
    ax.legend(loc="upper left")
    return to_svg(fig, "union")


def workload_figure(w: dict | None) -> str | None:
    """Each layer's active fraction (decode calls, prefill calls) against the profile's target
    and real OPT's figures of the same shape and prefix."""
    if w is None:
        return None
    fig, ax = _figure(10, 3.4)
    for i, (phase, label) in enumerate((("decode", "decode calls"), ("prefill", "prefill calls (union of the prompt)"))):
        if w[phase]:
            ax.plot(np.arange(len(w[phase])), w[phase], "o-", ms=3, color=colour(i), label=f"{label}, measured")
    if w["target"]:
        ax.plot(np.arange(len(w["target"])), w["target"], "--", color="0.3", label="profile target per token")
    for k, (label, value) in enumerate(w["anchors"]):  # a whole-model mean: a level, not a layer curve
        ax.axhline(value, ls=":", color=colour(k + 2), label=f"{label} (mean over layers)")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(f"active fraction of {w['unit']}")
    ax.set_title(f"activity by layer ({short(w['condition'])})")
    ax.legend(loc="best", fontsize=8)  # "lower right" sat on an MoE screen's flat decode line
    return to_svg(fig, "workload")


def plain_log_ticks(axis) -> None:
    """Ticks at 1, 2 and 5 per decade, written as plain numbers: within one decade matplotlib
    labelled its minor ticks 2x10^-1, 3x10^-1, 4x10^-1, 6x10^-1, a column of exponents."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def union_style(points: int) -> str:
    """matplotlib format of the union's measured medians: joined only when there are 3 or more."""
    return "o-" if points >= 3 else "o"


def energy_figure(en: dict[str, list[dict]], conditions: tuple[str, ...]) -> str | None:
    """Energy per scored episode and per generated token, per condition."""
    if not any(en.values()):
        return None
    fig, (left, right) = _figure(10, 3.4, ncols=2)
    _strip(left, [[x["energy_j"] for x in en[c]] for c in conditions], list(conditions))
    left.set_ylabel("J per episode")
    _strip(right, [[x["j_per_token"] for x in en[c]] for c in conditions], list(conditions))
    right.set_ylabel("J per generated token")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
    return to_svg(fig, "energy")


# ----------------------------------------------------------------------------- several screens


def compare_decode_figure(labels: list[str], per_screen: list[dict[str, list[float]]],
                          conditions: list[str]) -> str | None:
    """Decode ms/token per condition, one box per screen side by side."""
    if not any(v for s in per_screen for v in s.values()):
        return None
    fig, ax = _figure(10, 3.9)
    k = len(labels)
    width = 0.8 / k
    for s, (label, ms) in enumerate(zip(labels, per_screen)):
        pos = [n - 0.4 + width * (s + 0.5) for n in range(len(conditions))]
        data = [ms.get(c, []) for c in conditions]
        keep = [(p, d) for p, d in zip(pos, data) if d]
        if keep:
            bp = ax.boxplot([d for _, d in keep], positions=[p for p, _ in keep], widths=width * 0.85,
                            showfliers=False, patch_artist=True, medianprops={"color": "black"})
            for patch in bp["boxes"]:
                patch.set_facecolor(colour(s))
                patch.set_alpha(0.6)
        ax.plot([], [], "s", color=colour(s), alpha=0.6, label=label)
    condition_ticks(ax, conditions)
    log = wants_log(*(ms.get(c, []) for ms in per_screen for c in conditions))
    if log:  # a busy host's screen 100x slower than the other flattened the other's boxes
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("decode ms per token" + (" (log scale)" if log else ""))
    ax.legend(loc="upper right")
    return to_svg(fig, "compare-decode")


def compare_bars_figure(name: str, labels: list[str], values: list[dict[str, float | None]], conditions: list[str],
                        ylabel: str, scale: float = 1.0,
                        ranges: list[dict[str, tuple[float, float] | None]] | None = None) -> str | None:
    """One bar per (condition, screen): a per-condition figure of several screens. `ranges`
    (per screen, per condition: (low, high), e.g. p10 and p90) draw as error bars."""
    if not any(v is not None for s in values for v in s.values()):
        return None
    fig, ax = _figure(10, 3.6)
    k = len(labels)
    width = 0.8 / k
    for s, (label, vals) in enumerate(zip(labels, values)):
        xs = [n - 0.4 + width * (s + 0.5) for n in range(len(conditions))]
        ys = [(vals.get(c) or 0) / scale for c in conditions]
        ax.bar(xs, ys, width=width * 0.9, color=colour(s), alpha=0.8, label=label)
        spans = [(ranges[s].get(c) if ranges else None) for c in conditions]
        bars = [(x, y, lo / scale, hi / scale) for x, y, r in zip(xs, ys, spans) if r is not None
                for lo, hi in [r]]
        if bars:
            ax.errorbar([b[0] for b in bars], [b[1] for b in bars], fmt="none", ecolor="black", capsize=3, lw=1,
                        yerr=[[max(b[1] - b[2], 0) for b in bars], [max(b[3] - b[1], 0) for b in bars]])
    condition_ticks(ax, conditions)
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper right")
    return to_svg(fig, name)


def routing_figure(summary: dict) -> str:
    """An MoE checkpoint's routing (packbench model stats --figure): per layer the load curve
    (expert shares, busiest first, against uniform), consecutive and k-apart reuse against the
    same routing shuffled, and each cache size's LRU hit rate beside Belady's."""
    layers = summary["layers"]
    with style():
        fig, (load, reuse, cache) = _figure(11.0, 3.2, ncols=3)
        experts = summary["experts"]
        for r in layers:
            load.plot(range(1, experts + 1), r["loads"], color=colour(r["layer"]), label=f"layer {r['layer']}")
        load.axhline(1 / experts, color="grey", linestyle=":", label="uniform")
        load.set(xlabel="expert (busiest first)", ylabel="share of routed slots", title="load")
        for r in layers:
            ds = sorted(int(d) for d in r["reuse"])
            reuse.plot(ds, [r["reuse"][d] for d in ds], marker="o", color=colour(r["layer"]))
            reuse.axhline(r["reuse_shuffled"], color=colour(r["layer"]), linestyle=":")
        reuse.set(xlabel="tokens apart", ylabel="shared experts / k", title="reuse (dotted: shuffled)")
        for r in layers:
            cs = sorted(int(c) for c in r["cache"])
            cache.plot(cs, [r["cache"][c]["lru"] for c in cs], marker="o", color=colour(r["layer"]))
            cache.plot(cs, [r["cache"][c]["belady"] for c in cs], marker="^", linestyle="--", color=colour(r["layer"]))
        cache.set(xlabel="cache size (experts a layer)", ylabel="hit rate", title="LRU (o) and Belady (^)", ylim=(0, 1))
        load.legend(fontsize="small")
        return to_svg(fig, "routing")
