"""The report's layout as a reader sees it: axes ticked in plain numbers, long condition names
that neither run off the page nor over each other, panels that say why they are empty, and the
facts a figure needs to be read (a batched screen's batch)."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from packbench.cli import report_figures as figs
from packbench.core import report as data

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"


def drawn_text(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def test_the_union_plot_ticks_token_counts_as_plain_numbers():
    """Bug caught: the union-sparsity plot's log x axis (tokens in the call) was ticked 10^0,
    2x10^0, 3x10^0, 4x10^0, 6x10^0 on a screen of 8-token prefills (a column of exponents for
    counts of tokens); the other log axes of the page were already written in plain numbers."""
    union = {"condition": "packet", "neurons": 256, "unit": "neurons",
             "points": [(1, 0.10), (1, 0.12), (8, 0.5), (8, 0.52)], "curve": [(1, 0.11), (8, 0.51)]}
    with figs.style():
        svg = figs.union_figure(union)
    text = drawn_text(svg)
    assert not any("10^" in t or "times" in t or "mathdefault" in t for t in text), text
    assert not any(re.search(r"[\u00d7\u2212]", t) for t in text), text  # no x10^n glyphs either
    for tick in ("1", "2", "5"):
        assert tick in text, (tick, text)


LONG = [f"{p}-with-a-very-long-name-that-goes-on-and-on".ljust(60, "x") for p in ("dense-stream", "packet", "int8")]


def long_named(s):
    """gates-v2's serving rows as the int8 screen wrote them (dense-stream, packet, and int8: an
    approximate competitor whose first decode call and unshelve are written beside its steady
    call), and its runtime ratios under 60-character names."""
    rows = [{**r, "condition": n, "itl_p90_s": 0.110188, "itl_p99_s": 0.110188, "outside_wall_s": 0.0038}
            for r, n in zip(data.serving_rows(s), ("dense-stream", "packet", "int8"))]
    rows[2].update(tier="approximate", first_decode_excess_s=-0.001541, unshelve_s=0.002105)
    ratios = [{**r, "condition": n, "control": LONG[0]} for r, n in zip(data.runtime_ratios(s), LONG[1:])]
    return rows, ratios


def test_the_serving_and_runtime_tables_fit_the_page(tmp_path, monkeypatch):
    """Bugs caught: at 1400 px the serving table's last column (the steady decode call, the
    headline's figure) ran past the page behind a scroll bar whenever a competitor's cell read
    `-1.541 first call; unshelve 2.105 before the wall` (a nowrap line), and the runtime-ratio
    table wrote a 60-character control name in a nowrap cell, pushing its readings off the page."""
    from browser import INSTALL_HINT, check_page, chromium
    from packbench.cli.report_page import html_page, serving_section

    if chromium() is None:
        raise AssertionError(INSTALL_HINT)
    s = data.read_screen(DATA / "gates-v2.zip")
    rows, ratios = long_named(s)
    monkeypatch.setattr(data, "serving_rows", lambda screen: rows)
    monkeypatch.setattr(data, "runtime_ratios", lambda screen: ratios)
    section = serving_section(s)
    assert "-1.541 first call; unshelve 2.105 before the wall" in section
    assert f'<td class="name">{LONG[0]}</td>' in section.split('id="ratios"')[1]  # the control, wrapping
    page = tmp_path / "serving.html"
    page.write_text(html_page("serving", "", section))
    check = check_page(page, width=1400)
    assert [t["cls"] for t in check.tables][:2] == ["conditions", "conditions"]
    assert check.overflowing == [], check.tables


def test_the_comparison_and_sweep_tables_wrap_long_names(monkeypatch):
    """The comparison's runtime-ratio table and the sweep's table wrote a long control or
    condition name in a nowrap cell (the single-screen tables wrap theirs)."""
    from packbench.cli.report_page import AuditStatus, compare_page
    from packbench.cli.sweep_page import sweep_page

    s = data.read_screen(DATA / "gates-v2.zip")
    _, ratios = long_named(s)
    monkeypatch.setattr(data, "runtime_ratios", lambda screen: ratios)
    page = compare_page([s, s], [AuditStatus(), AuditStatus()])
    assert f"<td>{LONG[0]}</td>" not in page and f'<td class="name">{LONG[0]}</td>' in page
    point = SimpleNamespace(screen_id=1, values={"prefix_tokens": 8}, status="done", protocol_sha256="ab" * 32,
                            figures={LONG[1]: {"decode_ms_per_token": 1.0, "bytes_per_token": 100.0}}, verdicts=[])
    swept = sweep_page("sw-1", [point])
    assert f"<td>{LONG[1]}</td>" not in swept and f'<td class="name">{LONG[1]}</td>' in swept


def tick_rotations(svg: str, labels: list[str]) -> list[bool]:
    """Whether each label is drawn slanted under its axis (a rotate(-35) on its <text>; the wall
    figure's ratio panel also writes the names level, as its y ticks)."""
    out = []
    for label in labels:
        tags = re.findall(r"<text([^>]*)>" + re.escape(label) + "</text>", svg)
        assert tags, label
        out.append(any(re.search(r"rotate\(-35\b", t) for t in tags))  # level ticks carry rotate(-0 ...)
    return out


def test_long_condition_names_slant_instead_of_running_into_each_other():
    """Bug caught: three conditions of 60-character names (cut to 24 in figures) were written level
    under the half-width H2D and wall panels, each running into its neighbours; only more than
    five conditions slanted. Short names (gates-v2's four) stay level."""
    names = [figs.short(n) for n in LONG]
    per_call = {n: {"prefill": [100_000, 110_000], "decode": [10_000, 12_000]} for n in LONG}
    walls = {n: [(k, 0.2 + 0.01 * k) for k in range(3)] for n in LONG}
    s = data.read_screen(DATA / "gates-v2.zip")
    with figs.style():
        long_h2d = figs.h2d_figure(per_call, tuple(LONG), LONG[0])
        long_wall = figs.wall_figure(walls, [{"condition": n, "control": LONG[0], "value": 1.0, "interval": (0.9, 1.1),
                                              "threshold": None} for n in LONG[1:]], tuple(LONG))
        short_h2d = figs.h2d_figure(data.h2d_per_call(s), s.conditions, s.protocol.reference)
    assert tick_rotations(long_h2d, names) == [True] * 3 and tick_rotations(long_wall, names) == [True] * 3
    assert tick_rotations(short_h2d, list(s.conditions)) == [False] * len(s.conditions)


def test_the_wall_figure_draws_no_empty_ratio_panel(monkeypatch):
    """Bug caught: a screen of one condition (nothing paired with the control) drew an empty
    `runtime ratio: point and interval` panel over the axis label `wall / wall`, and the caption
    spoke of a right panel. A long control is cut in the ratio panel's label as the ticks are cut
    (a 60-character one ran past the panel)."""
    from packbench.cli.report_page import plots_section

    with figs.style():
        alone = figs.wall_figure({"dense-stream": [(1, 0.013)]}, [], ("dense-stream",))
        paired = figs.wall_figure({LONG[0]: [(1, 0.2)], LONG[1]: [(2, 0.1)]},
                                  [{"condition": LONG[1], "control": LONG[0], "value": 0.5, "interval": (0.4, 0.6),
                                    "threshold": None}], tuple(LONG[:2]))
    assert "episode wall" in drawn_text(alone)
    assert not any("runtime ratio" in t or "wall /" in t for t in drawn_text(alone))
    assert f"wall / {figs.short(LONG[0])} wall" in drawn_text(paired) and LONG[0] not in "".join(drawn_text(paired))
    s = data.read_screen(DATA / "quickstart-v1.zip")
    with figs.style():
        assert "Left: wall time of every scored episode. Right:" in plots_section(s)  # paired: the two panels
        monkeypatch.setattr(data, "runtime_intervals", lambda screen: [])
        page = plots_section(s)
    assert "Right:" not in page
    assert "Wall time of every scored episode; no runtime ratio: no condition pairs with the control." in page


def test_a_batched_screen_says_its_batch():
    """Bug caught: a `batch: 2` screen's report never said it was batched (nor the comparison of
    it beside a batch-1 screen), while its decode call (TPOT, ITL, the steady call) covers two
    tokens where its ms/token covers one: 48.4 ms TPOT beside 22.8 decode ms/token read as a
    contradiction. A batch-1 page says `1`; `scored_prompts` below the prompt count is named."""
    import dataclasses

    from packbench.cli.report_page import AuditStatus, compare_page, protocol_section, screen_page

    s = data.read_screen(DATA / "gates-v2.zip")
    batched = dataclasses.replace(s, protocol=dataclasses.replace(s.protocol, batch=2, scored_prompts=1))
    assert "<dt>batch</dt><dd>1</dd>" in protocol_section(s) and "scored prompts" not in protocol_section(s)
    facts = protocol_section(batched)
    assert "<dt>batch</dt><dd>2: every call decodes 2 prompts together (a decode call is 2 tokens)</dd>" in facts
    count = s.protocol.prompts.count
    assert f"<dt>scored prompts</dt><dd>1 of {count} start a scored episode each repetition</dd>" in facts
    lede = re.search(r'<p class="lede">([^<]*)</p>', screen_page(batched, audit=AuditStatus())).group(1)
    assert lede.startswith(f"{data.model_label(s)}, {s.protocol.dtype}, batch 2; ")
    assert ", batch" not in re.search(r'<p class="lede">([^<]*)</p>', screen_page(s, audit=AuditStatus())).group(1)
    ident = compare_page([s, batched], [AuditStatus(), AuditStatus()]).split("</table>")[0]
    assert "<th>batch</th>" in ident and ident.count('<td class="num">1</td>') == 1
    assert ident.count('<td class="num">2</td>') == 1


def partial_archive(path: Path, episodes: list[int], members=("protocol.json", "plan.json", "worker.json")) -> Path:
    """gates-v2's protocol, plan and worker record (`members`) with only these episodes: what an
    attempt that stopped (failed, cancelled) leaves, without a manifest."""
    from packbench.core.archive import ArchiveReader, ArchiveWriter, episode_member, logits_member

    src = ArchiveReader(DATA / "gates-v2.zip")
    w = ArchiveWriter(path)
    for name in members:
        w.add_json(name, src.read_json(name))
    for index in episodes:
        w.add_episode(src.read_json(episode_member(index)), src.read_array(logits_member(index)))
    w.close()
    return path


def test_a_screen_stopped_before_any_scored_episode_says_so(tmp_path):
    """Bug caught: a screen that failed before its first episode (FlexGen on a CPU worker) or was
    cancelled during its warmups had a headline and a 'what ran before' saying `no finished scored
    episode has a decode call after its first`, as if episodes had finished, only too short; its
    ITL cell read `- / -` under `-`. Now: no scored episode finished, N of M planned recorded."""
    from packbench.cli.report_page import AuditStatus, screen_page, serving_section
    from packbench.core.archive import ArchiveReader, episode_member

    src = ArchiveReader(DATA / "gates-v2.zip")
    warmups = [i for i in range(18) if src.read_json(episode_member(i))["role"] == "warmup"][:2]
    s = data.read_screen(partial_archive(tmp_path / "partial.zip", warmups))  # the warmups ran, then it stopped
    assert len(s.episodes) == 2 and s.planned == 18
    page = screen_page(s, audit=AuditStatus())
    why = "no scored episode finished (2 of 18 planned episodes recorded)"
    assert f"no steady decode call to rank: {why}" in page and f"no steady decode call to split: {why}" in page
    assert "has a decode call after its first" not in page and "- / -" not in serving_section(s)
    # a screen whose episodes finished, each of one decode call, keeps the other reason
    full = data.read_screen(DATA / "gates-v2.zip")
    for e in full.episodes:
        e.record["calls"] = [c for c in e.record["calls"] if c["phase"] == "prefill"] + \
            [c for c in e.record["calls"] if c["phase"] == "decode"][:1]
    assert "no steady decode call to split: no finished scored episode has a decode call after its first" in \
        screen_page(full, audit=AuditStatus())


def test_the_headline_names_a_failed_fidelity_where_it_ranks_a_condition(monkeypatch):
    """Bug caught: an nf4 condition of mean KL 0.47 (fidelity FAIL, the verdicts table below)
    headed the approximate tier as `nf4 150 ms (its TPOT ...)`, a plain winner; a condition that
    passed, or has no fidelity verdict, reads as before."""
    import dataclasses

    s = data.read_screen(DATA / "gates-v2.zip")
    rows = data.serving_rows(s)
    slow, fast = rows[1]["condition"], rows[2]["condition"]
    rows[1] = {**rows[1], "tier": "approximate", "steady_call_s": 0.002}
    rows[2] = {**rows[2], "tier": "approximate", "steady_call_s": 0.001}
    monkeypatch.setattr(data, "serving_rows", lambda screen: rows)
    verdicts = [{"gate": "fidelity", "condition": fast, "phase": "all", "passed": False},
                {"gate": "fidelity", "condition": slow, "phase": "all", "passed": True}]
    judged = dataclasses.replace(s, verdicts=[*s.verdicts, *verdicts])
    line = next(x for x in data.headline(judged) if x.startswith("Approximate tier"))
    assert line.startswith(f"Approximate tier, by the steady decode call ({rows[2]['episodes']} scored episodes): "
                           f"{fast} (fidelity FAIL) 1 ms (its TPOT ")
    assert f", 2x faster than the slowest, {slow}, " in line
    assert line.endswith(f"; order: {fast} (fidelity FAIL) 1, {slow} 2 ms")
    plain = next(x for x in data.headline(s) if x.startswith("Approximate tier"))
    assert "fidelity" not in plain and f": {fast} 1 ms (its TPOT " in plain


def test_the_comparison_screens_table_fits_beside_a_stopped_attempt(tmp_path):
    """Bug caught: beside a failed attempt (FlexGen on a CPU worker left only protocol.json: its
    label is the archive's 60-character file name, its GPU `unknown (no environment recorded)` in a nowrap cell) the comparison's
    screens table ran past the page at 1400 px, its audits column out of sight."""
    from browser import INSTALL_HINT, check_page, chromium
    from packbench.cli.report_page import AuditStatus, compare_page

    if chromium() is None:
        raise AssertionError(INSTALL_HINT)
    stopped = data.read_screen(partial_archive(
        tmp_path / "screen-00010-attempt-1-677c5bffe65c36d464fa2fc9eebbe025.zip", [], ("protocol.json",)))
    full = data.read_screen(DATA / "gates-v2.zip")
    page = tmp_path / "compare.html"
    page.write_text(compare_page([stopped, full, stopped], [AuditStatus(), AuditStatus(), AuditStatus()]))
    assert "unknown (no environment recorded)" in page.read_text()
    check = check_page(page, width=1400)
    assert check.tables and check.overflowing == [], check.tables


def test_a_sweep_of_stopped_screens_is_not_sent_to_dispatch(monkeypatch, tmp_path):
    """Bug caught: `report --sweep` of a sweep whose every screen had failed (FlexGen on a CPU
    worker) said `has no episodes yet; run its screens with packbench dispatch`, which runs no
    failed or cancelled screen. A sweep with a screen still queued or running keeps that advice."""
    from packbench.cli.sweep import report_sweep
    from packbench.core.errors import PackbenchError
    from packbench.service import sweep

    def point(n, status):
        return SimpleNamespace(screen_id=n, values={"prefix_tokens": n}, status=status, protocol_sha256="ab" * 32,
                               figures={}, verdicts=[])

    monkeypatch.setattr(sweep, "resolve_sweep", lambda store, ref: "sw-1")
    monkeypatch.setattr(sweep, "sweep_points", lambda store, sid: [point(14, "failed"), point(15, "cancelled")])
    with pytest.raises(PackbenchError) as stopped:
        report_sweep(None, "latest", tmp_path / "s.html")
    assert str(stopped.value) == ("sweep sw-1 has no finished scored episode and none to come (screens 14 failed, "
                                  "15 cancelled); `packbench screens show N` says why, `packbench screens retry N` "
                                  "queues one again")
    monkeypatch.setattr(sweep, "sweep_points", lambda store, sid: [point(14, "failed"), point(15, "queued")])
    with pytest.raises(PackbenchError) as waiting:
        report_sweep(None, "latest", tmp_path / "s.html")
    assert str(waiting.value) == "sweep sw-1 has no episodes yet; run its screens with `packbench dispatch`"
    assert not (tmp_path / "s.html").exists()


def test_report_sweep_json_prints_one_json_document(monkeypatch, tmp_path, capsys):
    """Bug caught: `report --sweep ID --json` printed `wrote FILE (N bytes)`, plain text, where
    `report SCREEN --json` prints {path, bytes, screens}: the sweep's page says the same, with its id."""
    import json

    from packbench.cli.sweep import report_sweep
    from packbench.service import sweep

    point = SimpleNamespace(screen_id=6, values={"continuation_tokens": 2}, status="done", protocol_sha256="ab" * 32,
                            figures={"packet": {"decode_ms_per_token": 1.0, "bytes_per_token": 100.0}}, verdicts=[])
    monkeypatch.setattr(sweep, "resolve_sweep", lambda store, ref: "sw-1")
    monkeypatch.setattr(sweep, "sweep_points", lambda store, sid: [point])
    out = tmp_path / "s.html"
    report_sweep(None, "latest", out, json_out=True)
    printed = capsys.readouterr().out
    assert json.loads(printed) == {"path": str(out), "bytes": out.stat().st_size, "sweep_id": "sw-1", "screens": [6]}
    report_sweep(None, "latest", out)
    assert capsys.readouterr().out == f"wrote {out} ({out.stat().st_size:,} bytes)\n"


def test_the_activity_legend_leaves_the_lines_visible(monkeypatch):
    """Bug caught: the activity-by-layer legend sat at the lower right, over the decode line of a
    qwen3-moe-tiny screen (every layer 0.25 of its experts, the axis's lowest value): a third of
    the line ran under the legend's text."""
    import numpy as np

    drawn = {}
    monkeypatch.setattr(figs, "to_svg", lambda fig, name: drawn.setdefault("fig", fig) and "")
    w = {"decode": [0.25, 0.25, 0.25], "prefill": [0.64, 0.64, 0.56], "target": None, "anchors": [],
         "unit": "experts", "condition": "packet"}
    with figs.style():
        figs.workload_figure(w)
        fig = drawn["fig"]
        fig.draw_without_rendering()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    xs = np.linspace(0, 2, 201)
    for ys in (w["decode"], w["prefill"]):
        line = ax.transData.transform(np.column_stack([xs, np.interp(xs, [0, 1, 2], ys)]))
        assert not any(legend.contains(x, y) for x, y in line)

