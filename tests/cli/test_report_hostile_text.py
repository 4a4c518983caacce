"""Text that users type reaching the report, comparison and sweep pages: a protocol's name, a
swept value. It is shown as text, never read as markup, and never stops the page being drawn."""

import dataclasses
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from packbench.cli.report_page import AuditStatus, compare_page, html_table
from packbench.cli.sweep_page import sweep_page
from packbench.core import report as data

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
HOSTILE = '<td><img src=x onerror=alert(1)></td></tr></table><script>alert(1)</script>'


def test_a_cell_that_looks_like_html_is_escaped():
    """html_table passed any cell that began with `<td` through as HTML: a protocol named
    `<td>...` closed the comparison's table and put its own elements on the page."""
    table = html_table(["protocol"], [[HOSTILE]])
    assert "<script>" not in table and "<img" not in table
    assert "&lt;td&gt;&lt;img src=x onerror=alert(1)&gt;" in table


def test_a_protocol_named_like_markup_stays_text_on_the_comparison_page():
    """The comparison's screens table wrote the protocol's name raw when it began with `<td`."""
    screen = data.read_screen(DATA / "quickstart-v1.zip")
    hostile = dataclasses.replace(screen, protocol=dataclasses.replace(screen.protocol, name=HOSTILE))
    page = compare_page([hostile, hostile], [AuditStatus(), AuditStatus()])
    assert "<script>" not in page and "<img" not in page
    assert page.count("</table>") == page.count("<table")


def test_a_swept_value_with_dollar_signs_is_drawn_as_written():
    """matplotlib read `$\\foo$` in a tick label as mathematics and raised mid-drawing: `report
    --sweep` of `--sweep 'name=a$\\foo$b,c'` exited 70 with a ParseFatalException."""
    def point(n, value):
        return SimpleNamespace(screen_id=n, values={"name": value}, status="done", protocol_sha256="ab" * 32,
                               figures={"packet": {"decode_ms_per_token": 1.0 + n, "bytes_per_token": 100.0 * n}},
                               verdicts=[{"condition": "packet", "gate": "faithfulness", "phase": "all",
                                          "passed": True}])

    page = sweep_page("sw-1", [point(1, "a$\\foo$b"), point(2, "$^$")])
    assert page.count('data-plot="') == 3
    drawn = re.findall(r"<text[^>]*>([^<]*)</text>", page)
    assert "name=a$\\foo$b" in drawn and "name=$^$" in drawn  # the tick labels, as typed


def test_a_commit_with_dollar_signs_is_drawn_in_the_history_page(tmp_path):
    """An archive from elsewhere records whatever commit its worker wrote: `$\\foo$` in a history
    tick label raised the same ParseFatalException (`history --html`, exit 70)."""
    from packbench.cli.history import history_page
    from packbench.db.store import Store
    from packbench.service.history import history
    sys.path.insert(0, str(DATA.parent / "api"))  # the archive-to-screen helper the API tests use
    from screens import QUICKSTART, ingest_archive

    with Store(f"sqlite:///{tmp_path / 'p.db'}") as store:
        store.upgrade()
        ingest_archive(store, QUICKSTART, commit="$\\foo$" + "a" * 34)
        page = history_page(history(store, "quickstart-v1"))
    assert "1\n$\\foo$a" in "\n".join(re.findall(r"<text[^>]*>([^<]*)</text>", page))


def test_log_axis_ticks_are_still_drawn_as_powers_of_ten():
    """Turning mathtext off for the whole report (a first fix of the `$` labels) wrote the union
    plot's log ticks as the literal text `$\\mathdefault{10^{0}}$`."""
    from packbench.cli.report_page import screen_page

    page = screen_page(data.read_screen(DATA / "gates-v2.zip"), audit=AuditStatus())
    drawn = re.findall(r"<text[^>]*>([^<]*)</text>", page)
    assert drawn and not any("mathdefault" in t for t in drawn)


def test_a_bidi_override_in_a_protocol_name_does_not_reverse_the_title():
    """A protocol named with U+202E (right-to-left override) reversed everything after it in the
    title: `screen 2, attempt 1` read `1 tpmetta ,2 neercs` in Chromium."""
    from packbench.cli.report_page import screen_page

    screen = data.read_screen(DATA / "quickstart-v1.zip")
    named = dataclasses.replace(screen, protocol=dataclasses.replace(screen.protocol, name="a\u202emany\u2067b"))
    page = screen_page(named, audit=AuditStatus())
    assert "\u202e" not in page and "\u2067" not in page
    assert "a\\u202emany\\u2067b" in page.split("</h1>")[0]


LONG = "c" + "-very_long.name" * 13  # 196 characters: letters, digits, `.`, `_`, `-` (no space to break at)


def test_a_long_condition_name_wraps_in_the_verdict_table():
    """The verdict table wrote a 196-character condition name in a nowrap cell: the table ran
    far past the page and squeezed its detail column into rows hundreds of pixels tall."""
    from packbench.cli.report_page import verdict_section

    screen = data.read_screen(DATA / "quickstart-v1.zip")
    named = dataclasses.replace(screen, verdicts=[{**v, "condition": LONG} for v in screen.verdicts])
    assert f'<td class="name">{LONG}</td>' in verdict_section(named)
    page = compare_page([named, named], [AuditStatus(), AuditStatus()])
    assert f"<td>{LONG}</td>" not in page and f'<td class="name">{LONG}</td>' in page
    from packbench.cli.report_template import CSS
    assert "\ntd.name {" in CSS  # every table's, not only table.conditions'


def test_a_short_condition_name_stays_on_one_line():
    """A squeezed table (the conditions table of the demo's report in Chromium) broke
    `dense-stream` at its hyphen over two lines; names up to SHORT_NAME characters now sit in a
    nowrap cell, and one character more wraps as a long name does."""
    from packbench.cli.report_page import SHORT_NAME, name_cell
    from packbench.cli.report_template import CSS

    assert str(name_cell("dense-stream")) == '<td class="name short">dense-stream</td>'
    assert str(name_cell("x" * SHORT_NAME)) == f'<td class="name short">{"x" * SHORT_NAME}</td>'
    assert str(name_cell("x" * (SHORT_NAME + 1))) == f'<td class="name">{"x" * (SHORT_NAME + 1)}</td>'
    assert "td.name.short { white-space: nowrap;" in CSS


def test_a_long_condition_name_is_shortened_in_the_figures():
    """A 196-character condition name drawn whole as a tick label collapsed the panels' axes
    (`constrained_layout not applied`) and ran across the runtime-ratio panel beside it."""
    from packbench.cli import report_figures as figs

    with figs.style():
        svgs = [figs.decode_figure({"dense-stream": [1.0, 1.1], LONG: [2.0, 2.1]}, ("dense-stream", LONG)),
                figs.wall_figure({"dense-stream": [(0, 1.0)], LONG: [(1, 1.2)]},
                                 [{"condition": LONG, "control": "dense-stream", "value": 1.2,
                                   "interval": (1.1, 1.3), "threshold": 2.0}], ("dense-stream", LONG))]
    for svg in svgs:
        drawn = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
        assert LONG not in "".join(drawn) and figs.short(LONG) in drawn
    assert len(figs.short(LONG)) <= figs.NAME_CHARS and figs.short("extents-2") == "extents-2"
    assert figs.short(LONG).startswith(LONG[:11]) and figs.short(LONG).endswith(LONG[-11:])
