"""`packbench report SCREEN [--out FILE.html]` and `packbench report --compare A B [...]`.

Thin: resolve each SCREEN to its raw archive (a path to a .zip, or a screen id / `latest`
through the database), read it (core.report.read_screen), add the audits the database
records for that very file, and write the page (cli/report_page.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from packbench.cli.common import DbUrl, Json, echo_json, not_a_file, open_store, write_output
from packbench.core.errors import PackbenchError
from packbench.core.text import error_line, one_line


def register(app: typer.Typer) -> None:
    app.command()(report)


def report(
    screens: Annotated[Optional[list[str]], typer.Argument(
        help="An archive file (.zip), or a screen id or `latest` (its latest attempt's archive, via the database). "
             "With --compare, two or more.", show_default=False)] = None,
    compare: Annotated[bool, typer.Option("--compare", metavar="", help="Put the screens side by side, with their verdict "
                                                            "agreement.")] = False,
    sweep: Annotated[Optional[str], typer.Option(
        "--sweep", help="Instead of screens: a sweep id (`submit --sweep`) or `latest` (the newest sweep); each condition's decode ms/token, bytes "
                        "per token and verdicts against the swept field.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", "-o", help="HTML file to write (default here: report-<archive stem or screen-ID>.html, "
                            "or compare-<...>.html).")] = None,
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Write one self-contained HTML report (no network at view time, plots inline) of a screen."""
    from packbench.cli.report_page import compare_page, screen_page

    screens = screens or []
    if sweep is not None:
        if screens or compare:
            raise PackbenchError("--sweep ID reports a whole sweep; give no screens and no --compare with it")
        _check_out(out)
        from packbench.cli.sweep import report_sweep

        report_sweep(open_store(db), sweep, out, json_out=json_out)
        return
    if compare and len(screens) < 2:
        raise PackbenchError("--compare needs two or more screens, e.g. `packbench report --compare 3 4`")
    if not compare and len(screens) != 1:
        raise PackbenchError(f"give one screen, or --compare with {len(screens)} of them")
    _check_out(out)
    try:
        loaded = [_load(ref, db) for ref in screens]
        names = [_name(ref, screen) for ref, (screen, _) in zip(screens, loaded)]
        if compare:
            page = compare_page([s for s, _ in loaded], [a for _, a in loaded])
            default = "compare-" + "-".join(names) + ".html"
        else:
            page = screen_page(loaded[0][0], audit=loaded[0][1])
            default = f"report-{names[0]}.html"
    except (TypeError, KeyError, AttributeError, ValueError, IndexError) as e:
        # An archive is read as written: a consistent forgery (manifest recomputed) whose worker.json
        # is null or whose verdicts are not objects reached the page's code (exit 70). The auditor
        # names the member and field; the report only says that it cannot be drawn.
        raise PackbenchError(f"{' '.join(screens)}: an archive holds a record that is not of the archive format "
                             f"({type(e).__name__}: {one_line(str(e))[:120]}); run `packbench audit archive FILE` "
                             f"to see which member") from e  # --debug shows where the page's code stopped
    path = out or Path(default)
    write_output(path, page, "--out")
    for screen, audit in ([] if compare else loaded):
        note = failure_note(screen, audit)
        if note is not None:
            typer.echo(note, err=True)  # stdout stays the path (or the JSON document)
    if json_out:
        echo_json({"path": str(path), "bytes": path.stat().st_size, "screens": list(screens)})
        return
    typer.echo(f"wrote {path} ({path.stat().st_size:,} bytes)")


def _check_out(out: Path | None) -> None:
    if out is not None and out.suffix.lower() not in (".html", ".htm"):
        raise PackbenchError(f"--out {out}: write the report to a .html file")
    if out is not None and not out.parent.is_dir():  # said before the archives are read
        raise PackbenchError(f"--out {out}: the directory {out.parent} does not exist; create it or choose "
                             f"another --out")


def _name(ref: str, screen) -> str:
    """An archive's file stem, or `screen-<id>` for a screen id or `latest`."""
    path = Path(ref)
    if path.is_file():
        return path.stem
    return f"screen-{screen.manifest.get('screen_id', ref)}"


def _load(ref: str, db: str | None):
    """(ScreenData, AuditStatus) for a SCREEN argument."""
    from packbench.cli.report_page import AuditStatus
    from packbench.core.report import read_screen

    path = Path(ref)
    if ref and (path.suffix == ".zip" or path.exists()):  # Path("") is ".", which exists
        kind = not_a_file(path)
        if kind == "missing":
            raise PackbenchError(f"no archive {ref}: give an existing .zip, or a screen id / `latest`")
        if kind is not None:
            raise PackbenchError(f"{ref} is {kind}, not an archive file; give a .zip, or a screen id / `latest`")
        screen = read_screen(path)
        if db is None:
            return screen, AuditStatus()
        try:  # an archive is reported without its database; the audits are looked up where it opens
            store = open_store(db)
        except PackbenchError as e:
            return screen, AuditStatus(note=f"audits not looked up: {e}")
        return screen, _audits(store, screen, screen_ref=screen.manifest.get("screen_id"))
    if not (ref.isdigit() or ref == "latest"):
        raise PackbenchError(f"{ref!r} is neither an archive file nor a screen id; give a .zip, an id or `latest`")
    store = open_store(db)
    screen_row = store.screen(ref)
    attempt = store.latest_attempt(screen_row.id)
    if attempt is None:
        raise PackbenchError(f"screen {screen_row.id} has no attempt yet; run it with `packbench dispatch`")
    archive = Path(attempt.archive_path)
    if not archive.is_file():
        raise PackbenchError(f"screen {screen_row.id}'s archive {archive} is not here; pass the archive file itself")
    screen = read_screen(archive)
    return screen, _audits(store, screen, screen_ref=screen_row.id)


def _audits(store, screen, *, screen_ref):
    """The audits the database records for the attempt that wrote this very file."""
    from packbench.cli.report_page import AuditStatus

    source = _redact(store.url)
    if screen_ref is None:
        return AuditStatus(source=source, note="the archive names no screen (no manifest): no audits to look up")
    try:
        detail = store.screen_detail(screen_ref)
    except PackbenchError as e:
        return AuditStatus(source=source, note=f"the database does not know this archive's screen: {e}")
    number = screen.manifest.get("attempt")
    for d in detail.attempts:
        a = d.attempt
        if number is not None and a.number != number:
            continue
        if a.archive_sha256 == screen.archive_sha256:
            return AuditStatus(source=source, rows=_audit_rows(d.audits), attempt=_attempt(a))
        if a.archive_sha256 is None and _same_file(a.archive_path, screen.path):
            # An attempt that did not finish stored no SHA-256 (its archive was never sealed): it is
            # found by its path, and only the audits that read these very bytes are its audits.
            mine = [u for u in d.audits if u.archive_sha256 == screen.archive_sha256]
            other = len(d.audits) - len(mine)
            return AuditStatus(source=source, rows=_audit_rows(mine), attempt=_attempt(a), note=None if not other else (
                f"{other} audit(s) of attempt {a.number} read other bytes at this path: the file changed since"))
    return AuditStatus(source=source, note=f"no attempt of screen {detail.screen.id} in the database stored this "
                                           f"file's SHA-256 {screen.archive_sha256[:16]}: not the audited archive")


def _attempt(a) -> dict:
    return {"number": a.number, "status": a.status, "error": a.error}


def failure_note(screen, audit) -> str | None:
    """The terminal's line about what failed on the page (the attempt's error, the failed
    episodes' first error); None when nothing did."""
    from packbench.cli.report_page import attempt_failed
    from packbench.core import report as data

    said = []
    a = audit.attempt
    if attempt_failed(a):
        said.append(f"attempt {a['number']} ended {a['status']}" + (f": {a['error']}" if a["error"] else ""))
    failures = data.failed_episodes(screen)
    if failures:
        first = failures[0]
        count = sum(len(f["episodes"]) for f in failures)
        said.append(f"{count} of {len(screen.episodes)} recorded episodes failed (first: episode {first['episodes'][0]} "
                    f"({first['condition']}): {first['error']})")
    # bounded as every error line is: an attempt's or episode's stored error may run to any length
    return error_line("note: " + "; ".join(said)) if said else None


def _audit_rows(audits) -> list[dict]:
    return [{"result": u.result, "machine": u.machine, "started": _when(u.started_at), "finished": _when(u.finished_at),
             "digest": u.digest, "problems": len(u.problems)} for u in audits]


def _same_file(stored: str | None, path: Path) -> bool:
    try:
        return stored is not None and Path(stored).resolve() == Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return False


def _when(moment) -> str | None:
    return moment.isoformat(timespec="seconds") if moment is not None else None


def _redact(url: str) -> str:
    """The database URL without a password."""
    return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)
