"""Query commands over the results database: results, screens list|show|cancel|retry,
compare, status.

Thin: each command validates its options, makes one `Store` call (`db.queries` does the
work) and formats the plain rows it gets back as a table, JSON or CSV.
"""

import csv
import dataclasses
import json
import sys
import textwrap
from datetime import datetime
from typing import Annotated, Any, Optional

import typer

from packbench.cli import labels
from packbench.cli.history import check_fail_above, fail_compare
from packbench.cli.common import DB_INT_MAX, DbUrl, Json, finite, open_store, seconds
from packbench.cli.summary import print_json, screen_summary, table, verdict_record, verdict_table
from packbench.core.archive import WORKER_NAME, ArchiveReader, ArchiveTooLarge, worker_parts
from packbench.core.errors import PackbenchError
from packbench.core.text import one_line, show
from packbench.core.protocol import DTYPE_NAMES, GATE_NAMES, PHASES
from packbench.core.record import SORT_NAMES
from packbench.core.registry import POLICY_NAMES  # condition names default to their policy's
from packbench.core.dispersion import noisy_host
from packbench.core.report import shared_gpu, shared_host

FORMATS = ("table", "json", "csv")
GATE_HELP = ", ".join(GATE_NAMES)
SORT_HELP = ", ".join(SORT_NAMES)

Format = Annotated[Optional[str], typer.Option("--format", help="Output: table, json or csv.",
                                               autocompletion=lambda: list(FORMATS))]
Limit = Annotated[Optional[int], typer.Option("--limit", max=DB_INT_MAX,
                                             help="At most this many rows; 0 for all.")]
ProtocolRef = Annotated[Optional[str], typer.Option("--protocol", help="Protocol name or SHA-256 prefix.")]


def register(app: typer.Typer) -> None:
    app.command()(results)
    screens_app = typer.Typer(no_args_is_help=True, help="Screens: list them, show, cancel or retry one.")
    screens_app.command("list")(screens_list)
    screens_app.command("show")(screens_show)
    screens_app.command("cancel")(screens_cancel)
    screens_app.command("retry")(screens_retry)
    screens_app.command("tag")(labels.screens_tag)
    app.add_typer(screens_app, name="screens")
    app.command()(compare)
    app.command()(status)


def results(
    screen: Annotated[Optional[str], typer.Option(
        "--screen", help="Screen id or `latest`. Without filters: that screen's verdicts and episodes "
                         "(default: latest). With filters or --format: only that screen's episodes.")] = None,
    protocol: ProtocolRef = None,
    model: Annotated[Optional[str], typer.Option(
        help="Substring of the model: its directory, or synth:<shape> for a synthetic one.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help=", ".join(DTYPE_NAMES) + ".",
                                                 autocompletion=lambda: list(DTYPE_NAMES))] = None,
    condition: Annotated[Optional[str], typer.Option(help="Condition name, e.g. packet.",
                                                     autocompletion=lambda: list(POLICY_NAMES))] = None,
    gate: Annotated[Optional[str], typer.Option(
        help=f"Only the episodes this gate judged, each once with its verdict: {GATE_HELP}.",
        autocompletion=lambda: list(GATE_NAMES))] = None,
    phase: Annotated[Optional[str], typer.Option(
        help="With --gate: only its verdict of this phase (all, prefill, decode); without, a gate's phases "
             "fold into one row.", autocompletion=lambda: list(PHASES))] = None,
    passed: Annotated[Optional[bool], typer.Option(
        "--passed/--failed", help="Only episodes whose --gate verdict passed (failed), or whose condition passed "
                                  "(failed) any gate without --gate.")] = None,
    status: Annotated[Optional[str], typer.Option(help="Episode status: ok or failed.",
                                                  autocompletion=lambda: ["ok", "failed"])] = None,
    role: Annotated[Optional[str], typer.Option(
        help="scored or warmup: e.g. --role scored --sort wall_s ranks the scored episodes alone.",
        autocompletion=lambda: ["scored", "warmup"])] = None,
    since: Annotated[Optional[str], typer.Option(help="Attempts started on or after this ISO date/time (UTC).")] = None,
    until: Annotated[Optional[str], typer.Option(
        help="Attempts started before this ISO date/time; a bare date includes that day.")] = None,
    machine: Annotated[Optional[str], typer.Option(help="Substring of the host, node or GPU name.")] = None,
    min_energy: Annotated[Optional[float], typer.Option(
        "--min-energy", callback=finite, help="Only episodes whose GPU energy (NVML, joules) is at least this.")] = None,
    max_energy: Annotated[Optional[float], typer.Option(
        "--max-energy", callback=finite, help="Only episodes whose GPU energy (NVML, joules) is at most this.")] = None,
    sort: Annotated[Optional[str], typer.Option(
        help=f"Order by this column (episodes without a value last): {SORT_HELP}.",
        autocompletion=lambda: list(SORT_NAMES))] = None,
    desc: Annotated[bool, typer.Option("--desc", metavar="", help="With --sort: largest first.")] = False,
    tag: labels.Tags = None,
    limit: Limit = None,
    fmt: Format = None,
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """List episodes matching filters, or show one screen's verdicts and episodes (no filters)."""
    from packbench.core.dates import check_order, parse_when
    from packbench.db.queries import ResultFilter

    filters = dict(protocol=protocol, model=model, dtype=dtype, condition=condition, gate=gate, phase=phase,
                   passed=passed, status=status, since=since, until=until, machine=machine,
                   min_energy_j=min_energy, max_energy_j=max_energy, sort=sort, role=role)
    if all(v is None for v in filters.values()) and not desc and fmt is None and limit is None and not tag:
        # `--screen ''` (an unset variable in a script) is refused by the store, not read as "latest"
        _screen_view(open_store(db), "latest" if screen is None else screen, json_out=json_out)
        return
    out = _output_format(fmt, json_out)
    limit = _limit(limit, default=1000)
    # Validate everything (unknown gate, bad dates) before touching the database.
    filters.update(since=None if since is None else parse_when(since, option="--since"),
                   until=None if until is None else parse_when(until, option="--until", end=True))
    check_order(filters["since"], filters["until"], since_text=since or "", until_text=until or "")
    ResultFilter(**filters, descending=desc)
    store = open_store(db)
    screen_id = store.screen(screen).id if screen is not None else None
    ids = labels.tagged(store, tag)
    rows = store.results(ResultFilter(**filters, descending=desc, screen_id=screen_id,
                                      limit=None if limit is None or ids is not None else limit + 1))
    rows = _truncated([r for r in rows if ids is None or r.screen_id in ids], limit)
    records, columns = _result_records(store, rows, gated=gate is not None, sort=sort)
    empty = "no episodes match"
    if not records and condition is not None:
        empty = _unknown_condition(store, condition) or empty
        if out != "table" and empty != "no episodes match":
            typer.echo(f"note: {empty}", err=True)  # stdout stays pure JSON / CSV
    _emit([Section(records, columns, empty=empty, fields=_result_fields(gated=gate is not None))], out)


def _result_fields(*, gated: bool) -> list[str]:
    """Every field of a `results` record, in order: the CSV header, the same with no matching
    episode as with many (a script reading column 20 must not meet 16 columns)."""
    from packbench.db.queries import ResultRow

    fields = [*ResultRow._fields, "tier"]
    return fields if gated else [f for f in fields if f not in ("gate", "phase", "passed", "value", "threshold")]


def _result_records(store, rows, *, gated: bool, sort: str | None = None) -> tuple[list[dict], list[str]]:
    """`results` rows as records with their tier, and the table's columns. Every row says its
    tier: exact and approximate conditions are never ranked together unlabelled. The `--sort`
    figure is a column: before, `--sort peak_sampled_bytes` (a GPU run's NVML peak) ranked the
    table by a figure it did not show, beside the allocator's peak."""
    records = [r._asdict() for r in rows]
    tiers = store.condition_tiers(r["protocol_sha256"] for r in records)
    for record in records:
        record["tier"] = tiers.get(record["protocol_sha256"], {}).get(record["condition"])
        if not gated:
            for key in ("gate", "phase", "passed", "value", "threshold"):
                del record[key]
    columns = ["screen_id", "attempt", "protocol", "dtype", "plan_index", "condition", "tier", "role", "prompt",
               "status", "h2d_bytes", "d2h_bytes", "wall_s", "call_s", "peak_allocated_bytes", "energy_j"]
    if sort is not None and sort not in columns:
        columns.append(sort)
    if any(r["fidelity_mean_kl"] is not None for r in records):
        columns += FIDELITY_COLUMNS
    if gated:
        columns += ["gate", "phase", "passed", "value", "threshold"]
    return records, columns


# An approximate episode's fidelity to its reference (core/fidelity.py), as `results` shows it.
FIDELITY_COLUMNS = ["fidelity_mean_kl", "fidelity_p99_kl", "fidelity_top1", "fidelity_max_abs_logit",
                    "fidelity_divergence_step"]


def _unknown_condition(store, condition: str) -> str | None:
    """When no stored episode has this condition: the line that says so, with the nearest name."""
    import difflib

    names = store.condition_names()
    if condition in names:
        return None
    near = difflib.get_close_matches(condition, names, n=1, cutoff=0.5)
    hint = f"; did you mean --condition {near[0]}?" if near else ""
    return (f"no episodes match: no episode has condition {show(condition)}{hint} (conditions: "
            f"{', '.join(names) or 'none yet'})")


def _screen_view(store, ref: str, *, json_out: bool) -> None:
    """One screen's latest attempt: its episodes, each condition's wall spread, verdicts and audit."""
    summary = screen_summary(store, ref)
    readings = readings_of(summary.get("archive_path"), screen_id=summary.get("screen_id"))
    if json_out:
        print_json({**summary, **(readings or {})})
        return
    typer.echo(one_line(f"screen {summary['screen_id']} ({summary['protocol']}, {summary['status']}) "
                        f"archive {summary['archive_path']}"))
    if summary["error"]:  # why the latest attempt did not end done, as `screens show` and --json say
        typer.echo(one_line(f"attempt {summary['attempt']} error: {summary['error']}"))
    columns = ["index", "condition", "tier", "role", "prompt", "status", "h2d_bytes", "d2h_bytes", "wall_s"]
    if any(e.get("fidelity_mean_kl") is not None for e in summary["episodes"]):
        columns += FIDELITY_COLUMNS
    if any("error" in e for e in summary["episodes"]):
        columns.append("error")
    typer.echo(table(summary["episodes"], columns))
    if summary["spread"]:
        typer.echo("episode wall per condition (scored ok episodes, seconds)")
        typer.echo(table(summary["spread"], ["condition", "tier", "n", "median", "p10", "p90", "p90_over_p10"]))
    if readings is not None and "archive_not_read" in readings:
        typer.echo(f"archive readings: none; {readings['archive_not_read']}")
    elif readings is not None:
        print_readings(readings)
    typer.echo(verdict_table(summary["verdicts"], caveat=summary["fidelity_caveat"]) if summary["verdicts"] else "no verdicts")
    a = summary.get("audit")
    typer.echo("audit: none; run `packbench audit`" if a is None else
               f"audit: {a['result'].upper()} ({a['kind'] or 'local'} on {_host_and_node(a['machine'], a['node'])}"
               f", {a['finished_at']}, digest {a['digest'][:16]}"
               f"{_sha_note(a['archive_sha256_matches'], a.get('archive_hashed', True))}; {a['audits']} audit(s))")


def readings_of(archive_path: str | None, *, screen_id: int | None = None) -> dict | None:
    """What the screen's archive says beside the stored totals (core/serving.py, docs/metrics.md):
    {serving: per condition, runtime_ratios: the median ratio beside the summed-walls gate,
    position: the plan-position check}; None when the archive is not readable here, and
    {archive_not_read: one line} when it is over the reader's size bound (its size, the bound and
    `packbench audit SCREEN --max-mib N`)."""
    from packbench.core.report import (expert_cache_rows, plan_positions, read_screen, runtime_ratios, serving_rows,
                                       steady_by_previous)

    if not archive_path:
        return None
    try:
        screen = read_screen(archive_path)
    except ArchiveTooLarge as e:
        return {"archive_not_read": e.line(None if screen_id is None else str(screen_id))}
    except (OSError, PackbenchError, ValueError, KeyError, TypeError):
        return None
    return {"serving": serving_rows(screen), "runtime_ratios": runtime_ratios(screen),
            "position": plan_positions([screen]), "steady_by_previous": steady_by_previous(screen),
            "expert_cache": expert_cache_rows(screen)}


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value * 1e3:.4g}"


def _ms3(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.3g}"


def _outliers_cell(flagged: dict) -> str:
    """`wall 1 (38); TPOT 1 (38)`: per figure, how many episodes lie beyond 3 IQR, and which."""
    parts = [f"{name} {len(v)} ({', '.join(map(str, v[:4]))}{'...' if len(v) > 4 else ''})"
             for name, v in (("wall", flagged.get("wall_s", [])), ("TTFT", flagged.get("ttft_s", [])),
                             ("TPOT", flagged.get("tpot_s", []))) if v]
    return "; ".join(parts) or "none"


SERVING_COLUMNS = ["condition", "tier", "n", "TTFT (first use)", "TPOT", "ITL p50/p90/p99", "tok/s", "wall",
                   "outside calls", "steady call", "once/episode", "beyond 3 IQR"]


def serving_table_rows(rows: list[dict]) -> list[dict]:
    """The serving figures as the table shows them: milliseconds to 3 digits, tokens per second."""
    return [{"condition": r["condition"], "tier": r["tier"], "n": r["episodes"],
             "TTFT (first use)": f"{_ms3(r['ttft_s'])} ({_ms3(r.get('ttft_first_s'))})",
             "TPOT": _ms3(r["tpot_s"]),
             "ITL p50/p90/p99": "/".join(_ms3(r[k]) for k in ("itl_p50_s", "itl_p90_s", "itl_p99_s")),
             "tok/s": "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.4g}",
             "wall": _ms3(r["wall_s"]), "outside calls": _ms3(r["outside_s"]),
             "steady call": _ms3(r["steady_call_s"]), "once/episode": _ms3(r["first_decode_excess_s"]),
             "beyond 3 IQR": _outliers_cell(r["outliers"])} for r in rows]


def ratio_table_rows(rows: list[dict]) -> list[dict]:
    """The runtime readings side by side: the gate's summed walls (frozen) and the median ratio."""
    out = []
    for r in rows:
        gi, m = r["gate_interval"], r["median"]
        gate = "-" if r["gate_value"] is None else f"{r['gate_value']:.4g}" + (f" [{gi[0]:.4g}, {gi[1]:.4g}]" if gi else "")
        if r["passed"] is not None:
            gate = ("PASS " if r["passed"] else "FAIL ") + gate
        out.append({"condition": r["condition"], "tier": r["tier"], "control": r["control"],
                    "summed walls (gate)": gate,
                    "median ratio": f"{m['value']:.4g} [{m['interval'][0]:.4g}, {m['interval'][1]:.4g}]",
                    "beyond 3 IQR": ", ".join(map(str, r["outliers"])) or "none",
                    "readings": ("DISAGREE " + r["because"]) if r["disagree"] else "agree"})
    return out


def print_readings(readings: dict) -> None:
    """The serving figures, the runtime ratios and the position check, as tables and a line."""
    from packbench.core.serving import position_text

    typer.echo("serving figures per condition, ms (scored ok episodes; docs/metrics.md)")
    typer.echo(table(serving_table_rows(readings["serving"]), SERVING_COLUMNS))
    if readings["runtime_ratios"]:
        typer.echo("runtime ratio: the gate's summed walls beside the ratio of medians (paired bootstrap intervals)")
        typer.echo(table(ratio_table_rows(readings["runtime_ratios"]),
                         ["condition", "tier", "control", "summed walls (gate)", "median ratio", "beyond 3 IQR",
                          "readings"]))
    if readings.get("steady_by_previous"):
        typer.echo("steady decode call by what the worker ran before (ms, episodes)")
        for r in readings["steady_by_previous"]:
            typer.echo(f"  {r['condition']} ({r['tier']}): " + "; ".join(
                f"after {p['condition']} {_ms(p['median']) or '-'} ({p['n']})" for p in r["previous"]))
    if readings.get("expert_cache"):
        typer.echo("expert caches and forecasts: hit rate beside Belady's optimum for the same capacity "
                   "(scored episodes; prefetched, used and wasted over every call, the prefill's included; "
                   "docs/metrics.md)")
        typer.echo(table(expert_cache_table_rows(readings["expert_cache"]), EXPERT_CACHE_COLUMNS))
    typer.echo(textwrap.fill(position_text(readings["position"]), width=110, subsequent_indent="  "))


EXPERT_CACHE_COLUMNS = ["condition", "cache", "hit rate / Belady", "decode hit rate / Belady", "decode ready",
                        "prefetched", "used", "wasted", "decode MB/token"]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def expert_cache_table_rows(rows: list[dict]) -> list[dict]:
    """The expert-cache readings as the table shows them: each hit rate beside Belady's."""
    return [{"condition": r["condition"],
             "cache": r["cache"],
             "hit rate / Belady": f"{_pct(r['hit_rate'])} / {_pct(r['belady_rate'])}",
             "decode hit rate / Belady": f"{_pct(r['decode_hit_rate'])} / {_pct(r['decode_belady_rate'])}",
             "decode ready": _pct(r["decode_ready_rate"]),
             "prefetched": r["prefetched"], "used": r["used"], "wasted": r["wasted"],
             "decode MB/token": "-" if r["decode_bytes_per_token"] is None else f"{r['decode_bytes_per_token'] / 1e6:.4g}"}
            for r in rows]


def _sha_note(matches: bool | None, hashed: bool = True) -> str:
    """Whether the latest audit read the archive whose SHA-256 the attempt stored."""
    if not hashed:
        return ", of an archive over the size bound, never hashed (`packbench audit SCREEN --max-mib N` reads it)"
    if matches is None:
        return ", of the unfinished attempt's partial archive (no SHA-256 stored)"
    return "" if matches else ", of another archive SHA-256"


def _host_and_node(host: str, node: str | None) -> str:
    from packbench.service.audit import host_and_node

    return host_and_node(host, node)


def screens_list(
    status: Annotated[Optional[str], typer.Option(
        help="queued, running, done, failed or cancelled.",
        autocompletion=lambda: ["queued", "running", "done", "failed", "cancelled"])] = None,
    protocol: ProtocolRef = None,
    tag: labels.Tags = None,
    name: Annotated[Optional[str], typer.Option("--name", help="Only screens of this name.")] = None,
    limit: Limit = None,
    fmt: Format = None,
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """List screens, newest first: each with its attempts, its latest attempt's status (`latest`)
    and the verdicts that attempt stored (`passed`, `failed`; `-` where it stored none: it is
    running, or it ended before its verdicts, as a worker that died does). An earlier attempt's
    verdicts are in `packbench screens show ID`."""
    out = _output_format(fmt, json_out)
    limit = _limit(limit, default=50)
    store = open_store(db)
    ids = labels.tagged(store, tag)
    if name is not None:
        named = {s.id for s in store.find_screens(name=name)}
        ids = named if ids is None else ids & named
    rows = store.list_screens(status=status, protocol=protocol,
                              limit=None if limit is None or ids is not None else limit + 1)
    rows = _truncated([r for r in rows if ids is None or r.id in ids], limit)
    records = [dataclasses.asdict(r) for r in rows]
    columns = ["id", "protocol", "protocol_sha256", "status", "created_at", "attempts", "latest", "passed", "failed"]
    columns += labels.label_columns(store, records)
    shown = [{**r, "protocol_sha256": r["protocol_sha256"][:12], "latest": r["latest_status"] or "-",
              **_verdict_counts(r), **({"tags": labels.tags_cell(r["tags"])} if "tags" in r else {})} for r in records]
    filtered = any(v is not None for v in (status, protocol, tag, name))
    empty = ("no screen matches; `packbench screens list` without filters lists every screen" if filtered
             else "no screens; submit one with `packbench submit`")
    from packbench.db.queries import ScreenSummary

    # CSV's header without a row is the rows' own (it was the table's: `latest` for `latest_status`)
    _emit([Section(records, columns, rows=shown, empty=empty, fields=_field_names(ScreenSummary))], out)


def _verdict_counts(row: dict) -> dict:
    """A `screens list` row's counts as the table shows them: `-` where the latest attempt stored
    no verdict, so a running or a died attempt does not read as "0 failed"."""
    stored = row["passed"] or row["failed"]
    return {"passed": row["passed"] if stored else "-", "failed": row["failed"] if stored else "-"}


def screens_show(
    screen: Annotated[str, typer.Argument(help="Screen id, or `latest`.")],
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Show a screen: every attempt (failed ones too) with its error, archive, verdicts and audits."""
    store = open_store(db)
    detail = store.screen_detail(screen)
    times = [attempt_time(d.attempt) for d in detail.attempts]
    if json_out:
        print_json(_plain({**dataclasses.asdict(detail), "time": times}))
        return
    s, p = detail.screen, detail.protocol
    typer.echo(one_line(f"screen {s.id}: {p.name} (protocol {p.sha256[:12]}, {p.model or '-'}, {p.dtype or '-'}), "
                        f"{s.status}, submitted by {s.submitter} at {_when(s.created_at)}"))
    typer.echo(one_line(f"model dir: {s.model_dir or '-'}; started {_when(s.started_at) or '-'}, "
                        f"finished {_when(s.finished_at) or '-'}"))
    if not detail.attempts:
        typer.echo(no_attempts_advice(s.id, s.status))
        return
    tiers = store.condition_tiers([p.sha256]).get(p.sha256, {})
    names, revoked = signer_names(store), signer_revocations(store)
    attempts, verdicts, audits = [], [], []
    for d in detail.attempts:
        a = d.attempt
        attempts.append({"attempt": a.number, "status": a.status, "worker": a.worker, "node": a.node,
                         "gpu": f"{a.gpu_name}:{a.gpu_index}", "started": _when(a.started_at),
                         "finished": _when(a.finished_at), "episodes": d.episodes, "failed": d.failed_episodes,
                         "archive": a.archive_path, "archive_sha256": (a.archive_sha256 or "")[:16] or None,
                         "signed by": _signer(a, names, revoked), "reconciled": _reconciled(a), "error": a.error})
        verdicts += [{"attempt": a.number, **verdict_record(v), "tier": tiers.get(v.condition)} for v in d.verdicts]
        audits += [{"attempt": a.number, "result": u.result, "digest": u.digest[:16], "kind": u.kind or "local",
                    "machine": u.machine, "node": (u.node or "")[:12] or "-", "finished": _when(u.finished_at),
                    "problems": len(u.problems)} for u in d.audits]
    typer.echo("\nattempts")
    typer.echo(table(attempts, list(attempts[0])))
    typer.echo("\ntime (s; from each attempt's archive)")
    typer.echo(table(times, list(times[0])))
    typer.echo("\nverdicts")
    typer.echo(verdict_table(verdicts, lead=("attempt",)) if verdicts else "none")
    typer.echo("\naudits")
    typer.echo(table(audits, ["attempt", "result", "digest", "kind", "machine", "node", "finished", "problems"])
               if audits else "none; run `packbench audit`")


def signer_names(store) -> dict[str, str]:
    """Each registered signing key's name, by key id (`packbench keys`)."""
    return {k.key_id: k.name for k in store.signers()}


def signer_revocations(store) -> dict[str, datetime]:
    """When each revoked signing key was revoked (`packbench keys revoke`), by key id."""
    return {k.key_id: k.revoked_at for k in store.signers() if k.revoked_at is not None}


def _signer(attempt, names: dict[str, str], revoked: dict[str, datetime] | None = None) -> str | None:
    """The key that signed the attempt's archive, whose it is, and when it was revoked if it was;
    None when unsigned."""
    key = getattr(attempt, "signer_key_id", None)
    if key is None:
        return None
    who = f"{key} {one_line(names[key])!r}" if key in names else f"{key} (not registered here)"
    when = (revoked or {}).get(key)
    return who if when is None else f"{who}, a key REVOKED at {_when(when)}"


def provenance_text(attempt, names: dict[str, str], revoked: dict[str, datetime] | None = None) -> str:
    """Where an attempt's archive was made and who signed it, for a line: `compare` said only
    "attempt 1 done", so a screen ingested from another lab read like one measured here."""
    signed = _signer(attempt, names, revoked)
    signed = "unsigned" if signed is None else f"signed by {signed}"
    if getattr(attempt, "ingested_from", None) is None:
        return signed
    return f"ingested from {attempt.node or 'an unknown host'}, {signed}"


def _reconciled(attempt) -> str | None:
    """When rows of the attempt came from its archive instead of the driver (db reconcile)."""
    if attempt.reconciled_at is None:
        return None
    n = attempt.reconciled_episodes or 0
    return f"{n} row{'s' if n != 1 else ''} at {_when(attempt.reconciled_at)} ({attempt.reconciled_check})"


def attempt_time(attempt) -> dict[str, Any]:
    """Where an attempt's time went, from its archive: claim to end, the model's load (cold or
    warm), the episodes' own walls, and the worker's time around them (each policy's activation
    and the measurements; archives made before it was recorded show None)."""
    # An ingested attempt's start and finish are when it was ingested here (an archive holds no
    # clock time): its claim-to-end read 0 s, a time nothing measured.
    ingested = getattr(attempt, "ingested_from", None) is not None
    row: dict[str, Any] = {"attempt": attempt.number, "model": attempt.model_state,
                           "claim_to_end": None if attempt.finished_at is None or ingested else
                           round((attempt.finished_at - attempt.started_at).total_seconds(), 3)}
    try:
        with ArchiveReader(attempt.archive_path) as archive:
            worker = archive.read_json(WORKER_NAME) if WORKER_NAME in archive.names else None
            start = worker_parts(worker).get("start") or {}
            records = [archive.read_json(e.record) for e in archive.episodes()]
    except (OSError, PackbenchError) as e:
        why = (f": {e.line(str(attempt.screen_id))}" if isinstance(e, ArchiveTooLarge)  # the size, bound and fix
               else f" ({type(e).__name__})")
        return {**row, "load": None, "episodes_wall": None, "around_episodes": None,
                "note": f"archive not readable here{why}"}
    load = start.get("entry_to_loaded_s")
    if attempt.model_state == "warm":
        load = 0.0  # the worker kept its model: nothing was read
    elif attempt.model_state != "cold" or not isinstance(load, (int, float)):
        load = None
    walls = [r.get("wall_s") or 0.0 for r in records]
    around = [r["episode_s"] - r["wall_s"] for r in records if r.get("wall_s") and r.get("episode_s")]
    note = f"{len(records)} episodes" + ("; ingested: its started and finished times are the ingest's" if ingested else "")
    shared = shared_gpu(records)
    if shared["episodes"]:
        note += (f"; GPU shared with pid {', '.join(map(str, sorted(shared['processes'])))} "
                 f"in {len(shared['episodes'])} of them")
    host = shared_host(records)
    if host["episodes"]:
        note += (f"; host shared with packbench worker pid {', '.join(map(str, sorted(host['workers'])))} "
                 f"in {len(host['episodes'])} of them")
    noisy = noisy_host(records)
    if noisy["episodes"]:
        note += (f"; host busy with other processes (>= {noisy['threshold']:g} core) in "
                 f"{len(noisy['episodes'])} of them")
    return {**row, "load": None if load is None else round(load, 3), "episodes_wall": round(sum(walls), 3),
            "around_episodes": round(sum(around), 3) if around else None, "note": note}


def screens_cancel(
    screen: Annotated[str, typer.Argument(help="Screen id, or `latest`.")],
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Cancel a screen: a queued one never runs; a running one stops after the episode in flight
    (its attempt is kept as cancelled, with its partial archive)."""
    store = open_store(db)
    row = store.cancel_screen(screen)
    if json_out:
        print_json(_plain(dataclasses.asdict(row)))
    elif row.status == "cancelled":
        typer.echo(f"screen {row.id} cancelled; it will not run (`packbench screens retry {row.id}` queues it again)")
    elif (gone := _gone_holder(store, row.id)) is not None:
        # Before, this said the screen stops once its dispatcher renews its lease: a killed
        # dispatcher never does, and nothing said what ends the attempt.
        typer.echo(f"screen {row.id} is running under dispatcher {gone.name}, whose process (pid {gone.pid} on "
                   f"this host) is gone: `packbench dispatch` marks its attempt lost and the screen cancelled")
    else:
        typer.echo(f"screen {row.id} is running: it stops after the episode in flight, once its dispatcher "
                   f"renews its lease (`packbench status` shows it)")


def _gone_holder(store, screen_id: int):
    """The dispatcher holding running screen `screen_id` when it ran on this host and its process
    is gone (what `status` calls `NO (its process is gone)`); None otherwise."""
    st = store.queue_status()
    name = next((r.dispatcher for r in st.running if r.screen_id == screen_id), None)
    holder = next((d for d in st.dispatchers if d.name == name), None)
    return holder if holder is not None and _liveness(holder) == "NO (its process is gone)" else None


def no_attempts_advice(screen_id: int, status: str) -> str:
    """What to do with a screen that has no attempt: only a queued one is run by `dispatch`."""
    if status == "queued":
        return "no attempts yet; run it with `packbench dispatch`"
    if status == "cancelled":
        return (f"no attempts: cancelled before any ran, so no `packbench dispatch` runs it; "
                f"`packbench screens retry {screen_id}` queues it again")
    return f"no attempts ({status})"


def screens_retry(
    screen: Annotated[str, typer.Argument(help="Screen id, or `latest`.")],
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Queue a failed or cancelled screen again; its earlier attempts are kept."""
    row = open_store(db).retry_screen(screen)
    if json_out:
        print_json(_plain(dataclasses.asdict(row)))
    else:
        typer.echo(f"screen {row.id} queued again (priority {row.priority}, up to {row.max_attempts} attempts); "
                   f"run it with `packbench dispatch`")


def _liveness(d) -> str:
    """A dispatcher's `live` column: its heartbeat, and on this host whether its process exists
    (a SIGKILLed one is dead at once, not after its heartbeat window)."""
    import platform

    from packbench.engine.gpu_lock import process_alive

    if d.host == platform.node() and d.pid is not None and not process_alive(d.pid):
        return "NO (its process is gone)"
    return "yes" if d.live else "NO (no heartbeat)"


def status(
    live_within: Annotated[float, typer.Option(
        "--live-within", callback=seconds, help="A dispatcher is live if it sent a heartbeat within this many seconds.")] = 30.0,
    fmt: Format = None,
    db: DbUrl = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Same as --format json.")] = False,
) -> None:
    """The queue: screens per state, running screens with progress and placement, the queue in
    claim order (with why a screen cannot be placed), dispatchers and their workers."""
    out = _output_format(fmt, json_out)
    st = open_store(db).queue_status(live_within_s=live_within)
    running = [{"screen": r.screen_id, "protocol": r.protocol, "attempt": r.attempt,
                "episodes": f"{r.episodes_done}/{r.episodes_total if r.episodes_total is not None else '?'}",
                "dispatcher": r.dispatcher, "node": r.node or None,
                "gpu": f"{r.gpu_name}:{r.gpu_index}" if r.gpu_name else None, "model": r.model_state,
                "shared_node": r.shared_node, "lease_until": _when(r.lease_expires_at),
                "cancel": "requested" if r.cancel_requested else None} for r in st.running]
    queued = [{"screen": q.screen_id, "protocol": q.protocol, "priority": q.priority,
               "attempts": f"{q.attempts_used}/{q.max_attempts}", "gpu_type": q.gpu_type,
               "node": q.placement_node, "replicas": (q.replica_group or "")[:8] or None,
               "unplaceable": q.unplaceable_reason} for q in st.queued]
    dispatchers = [{"id": d.id, "name": d.name, "host": d.host, "pid": d.pid,
                    "live": _liveness(d), "heartbeat": _when(d.heartbeat_at),
                    "idle": sum(w.get("state") == "idle" for w in d.workers),
                    "busy": sum(w.get("state") == "busy" for w in d.workers)} for d in st.dispatchers]
    # The workers of the dispatchers listed live: before, a SIGKILLed dispatcher on this host (live
    # "NO (its process is gone)", its heartbeat still fresh) still counted its workers as busy.
    live = [d for d in dispatchers if d["live"] == "yes"]
    st = dataclasses.replace(st, idle_workers=sum(d["idle"] for d in live), busy_workers=sum(d["busy"] for d in live))
    reconciled = [{"screen": r.screen_id, "attempt": r.attempt, "status": r.status,
                   "reconciled_at": _when(r.reconciled_at), "rows": r.episodes, "checked_against": r.check}
                  for r in st.reconciled]
    from packbench.db.status import DispatcherStatus, QueuedScreen, ReconciledAttempt, RunningScreen

    sections = [
        Section([dataclasses.asdict(r) for r in st.running], list(running[0]) if running else [], title="running",
                rows=running, fields=_field_names(RunningScreen)),
        Section([dataclasses.asdict(q) for q in st.queued], list(queued[0]) if queued else [],
                title="queued (claim order)", rows=queued, fields=_field_names(QueuedScreen)),
        Section([dataclasses.asdict(d) for d in st.dispatchers],
                list(dispatchers[0]) if dispatchers else [], title="dispatchers", rows=dispatchers,
                empty="none; start one with `packbench dispatch`", fields=_field_names(DispatcherStatus)),
        Section([dataclasses.asdict(r) for r in st.reconciled], list(reconciled[0]) if reconciled else [],
                title="reconciled (episode rows inserted from archives after a database outage; latest first)",
                rows=reconciled, empty="none", fields=_field_names(ReconciledAttempt)),
    ]
    if out != "table":
        counts = Section([{"state": state, "screens": n} for state, n in st.counts.items()], ["state", "screens"],
                         title="screens")
        _emit([counts, *sections], out, document=dataclasses.asdict(st))
        return
    typer.echo("screens: " + ", ".join(f"{n} {state}" for state, n in st.counts.items()) + "\n")
    _emit(sections[:2], out)
    if st.counts["queued"] > len(st.queued):
        typer.echo(f"... and {st.counts['queued'] - len(st.queued)} more")
    typer.echo("")
    _emit(sections[2:3], out)
    typer.echo(f"\nworkers of live dispatchers: {st.idle_workers} idle, {st.busy_workers} busy")
    if reconciled:
        typer.echo("")
        _emit(sections[3:], out)


def compare(
    screen_a: Annotated[Optional[str], typer.Argument(help="Screen id (or `latest`): the baseline A.")] = None,
    screen_b: Annotated[Optional[str], typer.Argument(help="Screen id (or `latest`): B, reported as B/A.")] = None,
    protocol: Annotated[Optional[str], typer.Option(
        "--protocol", help="Instead of A and B: every machine that screened this protocol (name or SHA-256 prefix), "
                           "verdict by verdict, and whether the machines agree (exit 1 when they do not).")] = None,
    fail_above: Annotated[Optional[float], typer.Option("--fail-above", metavar="PCT", help=(
        "Exit 1 when B's median wall, call or decode ms/token of a condition is more than PCT percent above A's, or "
        "an exact counter (bytes, rows, tokens) differs."))] = None,
    fmt: Format = None,
    db: DbUrl = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Same as --format json.")] = False,
) -> None:
    """Compare two screens' latest attempts (scored totals with B/A ratios, energy per episode and
    per generated token, and verdicts), or with --protocol every machine that screened one protocol."""
    out = _output_format(fmt, json_out)
    check_fail_above(fail_above, protocol=protocol)
    if protocol is not None:
        if screen_a is not None or screen_b is not None:
            raise PackbenchError("give two screen ids, or --protocol SHA alone")
        _compare_machines(open_store(db), protocol, out=out)
        return
    if screen_a is None or screen_b is None:
        raise PackbenchError("give two screen ids (or `latest`), or --protocol SHA to compare machines")
    store = open_store(db)
    c = store.compare(screen_a, screen_b)
    attempts = [store.latest_attempt(side.screen_id) for side in (c.a, c.b)]
    weights = [getattr(a, "model_sha256", None) for a in attempts]
    if None not in weights and weights[0] != weights[1]:
        typer.echo(f"warning: screens {c.a.screen_id} and {c.b.screen_id} measured different weights "
                   f"(checkpoint digests {weights[0][:12]} and {weights[1][:12]})", err=True)
    names, revoked = signer_names(store), signer_revocations(store)
    if out == "table":
        for label, side, attempt in (("A", c.a, attempts[0]), ("B", c.b, attempts[1])):
            typer.echo(one_line(f"{label}: screen {side.screen_id} ({side.protocol}, protocol "
                                f"{side.protocol_sha256[:12]}), attempt {side.attempt} {side.attempt_status}"
                                + ("" if attempt is None else f", {provenance_text(attempt, names, revoked)}")))
        typer.echo("")
    tiers = store.condition_tiers([c.a.protocol_sha256, c.b.protocol_sha256])
    both = {**tiers.get(c.b.protocol_sha256, {}), **tiers.get(c.a.protocol_sha256, {})}
    tier = lambda name: both.get(name)  # noqa: E731  (a condition's tier, from either protocol)
    metrics = [{"condition": m.condition, "tier": tier(m.condition), "metric": m.metric, "A": m.a, "B": m.b,
                "B/A": m.ratio} for m in c.metrics]
    verdicts = [{"gate": v.gate, "condition": v.condition, "tier": tier(v.condition), "phase": v.phase,
                 "A": _verdict(v.a_passed, v.a_value, v.a_interval_lo, v.a_interval_hi),
                 "B": _verdict(v.b_passed, v.b_value, v.b_interval_lo, v.b_interval_hi)} for v in c.verdicts]
    from packbench.core.dispersion import compare_spread
    from packbench.db.compare import MetricPair, VerdictPair

    spread = compare_spread(*[_scored_walls(store, a) for a in attempts])
    sharing = [_sharing(a) for a in attempts]
    _noise_warnings(c, sharing, spread)
    spread_rows = [{"condition": r["condition"], "tier": tier(r["condition"]), "A n": r["a"]["n"], "A median s": r["a"]["median"],
                    "A p10-p90 s": _range(r["a"]), "B n": r["b"]["n"], "B median s": r["b"]["median"],
                    "B p10-p90 s": _range(r["b"]), "B/A": r["mean_ratio"],
                    "B/A interval": None if r["ratio_lo"] is None else f"[{r['ratio_lo']:.4g}, {r['ratio_hi']:.4g}]",
                    "noise": r["noise"]} for r in spread]
    spread_records = [{"condition": r["condition"], "tier": tier(r["condition"]), **{f"{side}_{k}": r[side][k] for side in "ab" for k in r[side]},
                       **{k: r[k] for k in ("mean_ratio", "ratio_lo", "ratio_hi", "noise")}} for r in spread]
    readings = [readings_of(getattr(a, "archive_path", None)) if a is not None else None for a in attempts]
    serving_records, ratio_records = compare_readings(readings)
    document = {**dataclasses.asdict(c), "spread": spread_records,
                "serving": serving_records, "runtime_ratios": ratio_records,
                "position": {"a": None if readings[0] is None else readings[0]["position"],
                             "b": None if readings[1] is None else readings[1]["position"]},
                "metrics": [{**dataclasses.asdict(m), "tier": tier(m.condition)} for m in c.metrics],
                "verdicts": [{**dataclasses.asdict(v), "tier": tier(v.condition)} for v in c.verdicts],
                "shared_host": {"a": sharing[0], "b": sharing[1]},
                "provenance": {side: None if a is None else {
                    "signer_key_id": a.signer_key_id, "signer_name": names.get(a.signer_key_id),
                    "signer_revoked_at": None if a.signer_key_id not in revoked else revoked[a.signer_key_id].isoformat(),
                    "ingested_from": a.ingested_from} for side, a in zip("ab", attempts)}}
    _emit([Section([{**dataclasses.asdict(m), "tier": tier(m.condition)} for m in c.metrics],
                   ["condition", "tier", "metric", "A", "B", "B/A"],
                   title="scored episodes per condition (totals over ok episodes; peaks are maxima; energy over "
                         "those with an NVML reading)", rows=metrics, empty="no scored episodes",
                   fields=_field_names(MetricPair)),
           Section(spread_records, list(spread_rows[0]) if spread_rows else [], rows=spread_rows,
                   title="episode wall spread per condition (scored ok episodes; B/A of the mean walls and its 0.95 "
                         "bootstrap interval; within noise when it holds 1)", empty="no scored episodes"),
           Section(serving_records, ["condition", "tier", "figure", "A", "B", "B/A", "A beyond 3 IQR",
                                     "B beyond 3 IQR"],
                   rows=[{**r, "figure": _in_ms(r["figure"]),
                          **{k: _ms(r[k]) if r["figure"] != "decode_tokens_per_s" and r[k] is not None
                             else r[k] for k in ("A", "B")}} for r in serving_records],
                   title="serving figures per condition (ms, decode tokens/s; medians over scored ok episodes, "
                         "read from each archive; docs/metrics.md)", empty="no archive readable here"),
           Section(ratio_records, ["screen", "condition", "tier", "control", "summed walls (gate)", "median ratio",
                                   "beyond 3 IQR", "readings"],
                   title="runtime ratio within each screen: the gate's summed walls beside the ratio of medians",
                   empty="no runtime readings"),
           Section([{**dataclasses.asdict(v), "tier": tier(v.condition)} for v in c.verdicts],
                   ["gate", "condition", "tier", "phase", "A", "B"],
                   title="verdicts", rows=verdicts, fields=[*_field_names(VerdictPair), "tier"])],
          out, document=document)
    if out == "table":
        from packbench.core.serving import position_text

        for label, r in zip("AB", readings):
            if r is not None:
                typer.echo(f"{label}: {position_text(r['position'])}")
    if fail_above is not None:
        fail_compare(store, c.a.screen_id, c.b.screen_id, fail_above)


COMPARED_FIGURES = ("ttft_s", "ttft_first_s", "tpot_s", "itl_p50_s", "itl_p99_s", "decode_tokens_per_s", "steady_call_s",
                    "first_decode_excess_s", "wall_s", "outside_s")
# Whose outliers beyond 3 IQR stand beside a figure: its own where they are counted, else the walls'.
OUTLIERS_OF = {"ttft_s": "ttft_s", "tpot_s": "tpot_s", "decode_tokens_per_s": "tpot_s"}


def _in_ms(figure: str) -> str:
    """A compared figure's name where the table shows it in milliseconds: `ttft_s` read "ttft_s" beside
    a value in ms (the JSON keeps the name and the seconds)."""
    return figure if figure == "decode_tokens_per_s" else f"{figure.removesuffix('_s')} (ms)"


def compare_readings(readings: list[dict | None]) -> tuple[list[dict], list[dict]]:
    """Two screens' archive readings side by side: per condition and serving figure A, B and B/A
    with each side's outliers beyond 3 IQR (walls); and each screen's runtime ratios (summed walls
    beside medians), labelled by screen."""
    a, b = [{r["condition"]: r for r in (x or {}).get("serving", [])} for x in readings]
    serving = []
    for cond in list(a) + [c for c in b if c not in a]:
        ra, rb = a.get(cond), b.get(cond)
        for fig in COMPARED_FIGURES:
            va, vb = (None if r is None else r[fig] for r in (ra, rb))
            serving.append({"condition": cond, "tier": (ra or rb)["tier"], "figure": fig, "A": va, "B": vb,
                            "B/A": vb / va if va and vb is not None else None,
                            "A beyond 3 IQR": None if ra is None else len(ra["outliers"][OUTLIERS_OF.get(fig, "wall_s")]),
                            "B beyond 3 IQR": None if rb is None else len(rb["outliers"][OUTLIERS_OF.get(fig, "wall_s")])})
    ratios = [{"screen": label, **row} for label, x in zip("AB", readings)
              for row in ratio_table_rows((x or {}).get("runtime_ratios", []))]
    return serving, ratios


def _noise_warnings(c, sharing: list, spread: list[dict]) -> None:
    """On stderr: a screen whose host was shared or busy, and a wall ratio inside its own noise."""
    for label, side, note in zip("AB", (c.a, c.b), sharing):
        if note:
            typer.echo(f"warning: screen {side.screen_id} ({label}) ran on a shared or busy host: {note}; its "
                       f"times may be inflated", err=True)
    for r in spread:
        if r["noise"] == "within noise" and r["mean_ratio"] is not None:
            typer.echo(f"warning: condition {r['condition']}: wall B/A {r['mean_ratio']:.4g} is within "
                       f"noise: its 0.95 bootstrap interval [{r['ratio_lo']:.4g}, {r['ratio_hi']:.4g}] holds 1",
                       err=True)


def _range(s: dict) -> str | None:
    return None if s["p10"] is None else f"{s['p10']:.4g}-{s['p90']:.4g}"


def _scored_walls(store, attempt) -> dict[str, list[float]]:
    """condition -> wall_s of the attempt's finished scored episodes."""
    out: dict[str, list[float]] = {}
    for e in store.episodes(attempt.id) if attempt is not None else []:
        if e.role == "scored" and e.status == "ok" and e.wall_s is not None:
            out.setdefault(e.condition, []).append(e.wall_s)
    return out


def _sharing(attempt) -> str | None:
    """What shared the attempt's host or GPU during its episodes, from its archive (None: nothing
    seen, or the archive is not readable here)."""
    try:
        with ArchiveReader(attempt.archive_path) as archive:
            records = [archive.read_json(e.record) for e in archive.episodes()]
    except (OSError, PackbenchError, AttributeError, TypeError):
        return None
    notes = []
    host, gpu = shared_host(records), shared_gpu(records)
    if host["episodes"]:
        notes.append(f"packbench worker pid {', '.join(map(str, sorted(host['workers'])))} busy in "
                     f"{len(host['episodes'])} of {len(records)} episodes")
    if gpu["episodes"]:
        notes.append(f"GPU shared with pid {', '.join(map(str, sorted(gpu['processes'])))} in "
                     f"{len(gpu['episodes'])} of {len(records)} episodes")
    noisy = noisy_host(records)
    if noisy["episodes"]:
        notes.append(f"other processes kept >= {noisy['threshold']:g} core busy in {len(noisy['episodes'])} of "
                     f"{len(records)} episodes (up to {noisy['worst']:.2g} cores)")
    return "; ".join(notes) or None


def _compare_machines(store, protocol: str, *, out: str) -> None:
    from packbench.service.compare import compare_machines

    c = compare_machines(store, protocol)
    tiers = store.condition_tiers([c.protocol_sha256]).get(c.protocol_sha256, {})
    labels = [f"[{i + 1}]" for i in range(len(c.columns))]
    if out != "table":
        # One row per verdict; each machine's cell as PASS/FAIL and its value.
        rows = [{"gate": r.gate, "condition": r.condition, "tier": tiers.get(r.condition), "phase": r.phase,
                 **{f"{label} screen {col.screen_id}": (None if cell is None else _verdict(*cell))
                    for label, col, cell in zip(labels, c.columns, r.cells)}, "agree": r.agree} for r in c.rows]
        _emit([Section(rows, list(rows[0]) if rows else ["gate", "condition", "tier", "phase", "agree"])], out,
              document={**dataclasses.asdict(c), "agree": c.agree, "hosts": c.hosts})
    else:
        hosts = c.hosts
        typer.echo(one_line(f"protocol {c.protocol} ({c.protocol_sha256[:12]}): {len(c.columns)} screen(s) on "
                            f"{len(hosts)} machine(s) ({', '.join(hosts)})"))
        for i, col in enumerate(c.columns):
            typer.echo(one_line(f"  [{i + 1}] screen {col.screen_id} attempt {col.attempt}: {col.machine}, "
                                f"Ray node {col.node[:8]}"))
        for line in c.skipped:
            typer.echo(f"  skipped {line}")
        rows = [{"gate": r.gate, "condition": r.condition, "tier": tiers.get(r.condition), "phase": r.phase,
                 **{label: ("-" if cell is None else _verdict(*cell)) for label, cell in zip(labels, r.cells)},
                 "agree": "yes" if r.agree else "NO"} for r in c.rows]
        typer.echo(table(rows, ["gate", "condition", "tier", "phase", *labels, "agree"]) if rows else "no verdicts")
        typer.echo(f"verdicts agree across machines: {'yes' if c.agree else 'NO'}")
    digests = {col.model_sha256 for col in c.columns}
    if len(digests) > 1:
        known = sorted(d[:12] for d in digests if d)
        typer.echo(f"warning: the machines measured different weights (checkpoint digests "
                   f"{', '.join(known) or 'unknown'}{' and unrecorded' if None in digests else ''}): "
                   f"the same protocol hash does not mean the same model", err=True)
    if not c.agree:
        raise typer.Exit(1)


# -- formatting ------------------------------------------------------------------------------


def _output_format(fmt: str | None, json_out: bool) -> str:
    if fmt is not None and fmt not in FORMATS:
        raise PackbenchError(f"unknown --format {fmt!r}; use one of {', '.join(FORMATS)}")
    if json_out and fmt not in (None, "json"):
        raise PackbenchError(f"--json and --format {fmt} disagree; give only one of them")
    return "json" if json_out else fmt or "table"


def _limit(limit: int | None, *, default: int) -> int | None:
    """The row limit to apply: `default` when not given, None (all rows) for 0."""
    if limit is None:
        return default
    if limit < 0:
        raise PackbenchError(f"--limit {limit} is negative; give a row count, or 0 for all rows")
    return limit or None


def _truncated(rows: list, limit: int | None) -> list:
    """Rows asked for with limit + 1: keep `limit`, and say on stderr that more matched."""
    if limit is not None and len(rows) > limit:
        typer.echo(f"note: showing the first {limit} rows; more match: pass --limit 0 for all, or narrow "
                   f"the filters", err=True)
        return rows[:limit]
    return rows


def _when(moment: datetime | None) -> str | None:
    return moment.isoformat(timespec="seconds") if moment is not None else None


def _plain(value: Any) -> Any:
    """JSON-ready: datetimes as ISO 8601, tuples as lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _verdict(passed: bool | None, value: float | None, lo: float | None = None, hi: float | None = None) -> str:
    """`FAIL 0.995228 [0.4496, 2.493]`: the verdict, its value and the interval it was judged on."""
    if passed is None:
        return "-"
    interval = f" [{lo:.4g}, {hi:.4g}]" if lo is not None and hi is not None else ""
    return ("PASS" if passed else "FAIL") + (f" {value:.6g}" if value is not None else "") + interval


@dataclasses.dataclass(frozen=True)
class Section:
    """One table of a command's output.

    records: every field of each row, for CSV (and JSON when the command has no document).
    columns: the fields the table shows. rows: what the table shows, when it is not records
    (combined or shortened fields). title: the table's heading, and CSV's `section` column
    when a command prints several tables. empty: the table's text when there are no rows.
    """

    records: list[dict]
    columns: list[str]
    empty: str = "none"
    title: str | None = None
    rows: list[dict] | None = None
    fields: list[str] | None = None  # CSV's header when there may be no record to take it from

    def header(self) -> list[str]:
        if self.records:
            return list(self.records[0])
        return self.fields if self.fields is not None else self.columns


def _emit(sections: list[Section], out: str, *, document: Any = None) -> None:
    """The one formatter of `results`, `screens list`, `compare` and `status`.

    json: `document` (the command's object), else the single section's records as a list.
    csv: a header and every record; with several sections a leading `section` column names
    each row's table, and the header is the union of their fields. table: each section as an
    aligned table under its title. Only the output goes to stdout: notes go to stderr.
    """
    if out == "json":
        print_json(_plain(document if document is not None else sections[0].records))
    elif out == "csv":
        several = len(sections) > 1
        fields = ["section"] if several else []
        for section in sections:
            for name in section.header():
                if name not in fields:
                    fields.append(name)
        writer = csv.DictWriter(sys.stdout, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for section in sections:
            for record in section.records:
                row = {k: _csv_value(v) for k, v in record.items()}
                writer.writerow({"section": section.title, **row} if several else row)
    else:
        for i, section in enumerate(sections):
            if section.title is not None:
                typer.echo(("\n" if i else "") + section.title)
            rows = section.rows if section.rows is not None else section.records
            if not rows:
                typer.echo(section.empty)
                continue
            rows = [{**r, **{k: _when(v) for k, v in r.items() if isinstance(v, datetime)}} for r in rows]
            for row in rows:
                if isinstance(row.get("passed"), bool):
                    row["passed"] = "PASS" if row["passed"] else "FAIL"
            typer.echo(table(rows, section.columns))


def _field_names(record_type: type) -> list[str]:
    return [f.name for f in dataclasses.fields(record_type)]


def _csv_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return _when(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(_plain(value), sort_keys=True)
    return value
