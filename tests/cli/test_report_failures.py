"""`packbench report` says why a screen's attempt or its episodes failed: the attempt's stored
error (the database's) and each failed episode's error (the archive's), on the page and in one
line on the terminal."""

import html
import re
from pathlib import Path

from packbench.core import report as data
from packbench.core.archive import ArchiveReader, ArchiveWriter, episode_member, logits_member
from packbench.db.store import Store

DATA = Path(__file__).resolve().parents[1] / "data"
OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"


def interrupted_archive(path: Path, *, failed: dict[int, str]) -> Path:
    """gates-v2.zip's protocol and episodes, unsealed (an attempt that did not finish), with the
    episodes of `failed` (plan index -> error) recorded as failed."""
    src = ArchiveReader(DATA / "gates-v2.zip")
    w = ArchiveWriter(path)
    for name in ("protocol.json", "plan.json", "worker.json"):
        w.add_json(name, src.read_json(name))
    for index in range(18):
        record = src.read_json(episode_member(index))
        if index in failed:
            record = {**record, "status": "failed", "error": failed[index]}
        w.add_episode(record, src.read_array(logits_member(index)))
    w.close()
    return path


def page_text(page: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


def test_failed_episodes_are_grouped_by_condition_and_error(tmp_path):
    failed = {3: OOM, 9: OOM, 12: "ValueError: x\nmore", 5: OOM}  # 3, 9, 12: packet; 5: extents
    s = data.read_screen(interrupted_archive(tmp_path / "a.zip", failed=failed))
    assert data.failed_episodes(s) == [
        {"condition": "packet", "error": OOM, "episodes": [3, 9]},
        {"condition": "extents", "error": OOM, "episodes": [5]},
        {"condition": "packet", "error": "ValueError: x", "episodes": [12]},
    ]
    assert data.failed_episodes(data.read_screen(DATA / "gates-v2.zip")) == []


def test_report_of_a_failed_attempt_says_why(packbench_cli, tmp_path):
    """Bug caught: the report of a failed attempt showed "(n failed)" beside a condition and
    "the screen did not finish", but neither the attempt's stored error nor any episode's."""
    archive = interrupted_archive(tmp_path / "attempt-1.zip", failed={3: OOM})
    url = f"sqlite:///{tmp_path / 'pb.db'}"
    with Store(url) as store:
        store.upgrade()
        protocol = store.put_protocol(sha256="ab" * 32, name="gates", canonical_json="{}")
        screen = store.create_screen(protocol_id=protocol, submitter="alice", max_attempts=1)
        attempt = store.start_attempt(screen_id=screen, worker="w", node="n", gpu_name="cpu", gpu_index=0,
                                      machine_id=None, source_freeze={}, archive_path=str(archive))
        store.finish_attempt(attempt.id, status="interrupted", error="the worker's process died (exit 137)")
    r = packbench_cli("report", str(screen), "--out", "r.html", "--db", url, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = page_text((tmp_path / "r.html").read_text())
    assert "Attempt 1 ended interrupted: the worker's process died (exit 137)" in text, text[:2000]
    assert "Failures: 1 of 18 recorded episodes failed" in text and OOM in text
    [note] = r.stderr.splitlines()
    assert note.startswith("note: attempt 1 ended interrupted: the worker's process died (exit 137); "
                           "1 of 18 recorded episodes failed (first: episode 3 (")
    assert note.endswith(f"): {OOM})") and r.stdout.startswith("wrote r.html")


def test_a_report_without_failures_has_no_failure_section():
    from packbench.cli.report_page import AuditStatus, screen_page

    page = screen_page(data.read_screen(DATA / "gates-v2.zip"), audit=AuditStatus())
    assert 'id="failures"' not in page


def test_a_runtime_line_without_summed_walls_says_so(tmp_path):
    """Bug caught: where the runtime gate had no reading (an unfinished attempt whose failed
    episodes leave its pairs incomplete), the headline read "packet (exact) over dense-stream: ;
    ratio of medians ...", an empty reading before the semicolon."""
    s = data.read_screen(interrupted_archive(tmp_path / "a.zip", failed={3: OOM}))
    runtime = [line for line in data.headline(s) if " over dense-stream: " in line]
    assert runtime and not any(": ;" in line for line in runtime)
    bare = [line for line in runtime if line.startswith("packet ")]
    assert bare and bare[0].startswith("packet (exact) over dense-stream: no summed walls; ratio of medians ")


def test_a_running_attempt_is_not_reported_as_ended():
    """Bug caught: `report` of a screen still running said "Attempt 1 ended running" in the
    Failures section (in red) and "note: attempt 1 ended running" on the terminal."""
    from packbench.cli.report import failure_note
    from packbench.cli.report_page import AuditStatus, screen_page

    s = data.read_screen(DATA / "gates-v2.zip")
    running = AuditStatus(attempt={"number": 1, "status": "running", "error": None})
    assert 'id="failures"' not in screen_page(s, audit=running)
    assert failure_note(s, running) is None
    died = AuditStatus(attempt={"number": 1, "status": "lost", "error": None})
    assert "Attempt 1 ended lost" in page_text(screen_page(s, audit=died))


def test_a_long_html_error_is_escaped_on_the_page_and_bounded_on_the_terminal(tmp_path):
    """Bug caught: the terminal's note quoted a stored error whole (a 10,000-character error
    made a 20,000-character line); the page must show it escaped, never as markup."""
    from packbench.cli.report import failure_note
    from packbench.cli.report_page import AuditStatus, screen_page
    from packbench.core.text import ERROR_LINE_LIMIT

    evil = "<script>alert(1)</script><b>x</b>&amp;" + "A" * 10_000
    s = data.read_screen(interrupted_archive(tmp_path / "a.zip", failed={i: evil for i in range(18)}))
    audit = AuditStatus(attempt={"number": 2, "status": "failed", "error": evil + "\n<img src=x onerror=alert(2)>"})
    page = screen_page(s, audit=audit)
    assert "<script>" not in page and "<img" not in page and "<b>x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&lt;b&gt;x&lt;/b&gt;&amp;amp;" in page
    assert "Failures: 18 of 18 recorded episodes failed" in page_text(page)
    note = failure_note(s, audit)
    assert len(note) <= ERROR_LINE_LIMIT and "\n" not in note
    assert note.startswith("note: attempt 2 ended failed: <script>") and "characters cut" in note


def test_an_error_that_starts_with_blank_lines_is_grouped_by_its_first_words(tmp_path, packbench_cli):
    """Catches failed_episodes taking an error's first line as it stands: an error text that starts
    with a newline (or blank lines) showed an empty error cell on the report page."""
    failed = {3: "\n  \nValueError: x\nmore", 9: "\nValueError: x", 12: "\n\n"}  # all packet
    archive = interrupted_archive(tmp_path / "a.zip", failed=failed)
    assert data.failed_episodes(data.read_screen(archive)) == [
        {"condition": "packet", "error": "ValueError: x", "episodes": [3, 9]},
        {"condition": "packet", "error": "no error recorded", "episodes": [12]},
    ]
    r = packbench_cli("report", str(archive), "--out", "r.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert '<td class="wrap fail">ValueError: x</td>' in (tmp_path / "r.html").read_text()
