"""`packbench audit archive|screen|reexecute`: one mode per invocation, each with its own options.

archive    FILE...            archive files alone: hashes, signature (--trust), every verdict; no database
screen     SCREEN... | --all  each screen's latest attempt against the database, here or as Ray tasks
reexecute  SCREEN... --count K  re-run K drawn episodes on a worker and compare with the archive

The older one-command forms keep their meaning: a first word that is no subcommand is routed by
`route_legacy` (`audit latest` and `audit --all --ray` are `audit screen ...`, `audit --archive
FILE` is `audit archive FILE`, `audit SCREEN --reexecute K` is `audit reexecute SCREEN --count K`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from packbench.cli.common import DbUrl, finite, not_a_file, settings_of
from packbench.cli.summary import verdict_table
from packbench.core.errors import PackbenchError
from packbench.core.text import one_line

SUBCOMMANDS = ("archive", "screen", "reexecute")
SELECTORS = frozenset({"--all", "--since", "--protocol"})  # database forms: never an archive alone


def route_legacy(args: list[str], takes_value: frozenset[str]) -> list[str]:
    """The subcommand form of a one-command `audit` invocation (`takes_value`: the options that
    take a value, so a value is never read as a screen id)."""
    positional, seen, i = [], set(), 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            positional += args[i + 1:]
            break
        if arg.startswith("-") and arg != "-":
            name = arg.split("=", 1)[0]
            seen.add(name)
            i += 1 if "=" in arg or name not in takes_value else 2
            continue
        positional.append(arg)
        i += 1
    if "--reexecute" in seen:
        return ["reexecute", *(("--count" + a[len("--reexecute"):]) if a.split("=", 1)[0] == "--reexecute" else a
                               for a in args)]
    if "--archive" in seen and not positional and not seen & SELECTORS:
        out, i = ["archive"], 0
        while i < len(args):
            if args[i] == "--archive":
                out += args[i + 1:i + 2]
                i += 2
                continue
            out.append(args[i].split("=", 1)[1] if args[i].startswith("--archive=") else args[i])
            i += 1
        return out
    return ["screen", *args]


class AuditGroup(TyperGroup):
    """`audit`'s subcommands, with the one-command forms routed to them (`route_legacy`)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            takes_value = frozenset({"--reexecute"} | {name for command in self.commands.values()
                                                       for p in command.params
                                                       if p.param_type_name == "option" and not p.is_flag
                                                       for name in p.opts})
            args = route_legacy(list(args), takes_value)
        return super().parse_args(ctx, args)


audit_app = typer.Typer(cls=AuditGroup, help=(
    "Re-read raw archives, recompute every metric and verdict, compare with the database: `audit archive FILE...`, "
    "`audit screen SCREEN... | --all`, `audit reexecute SCREEN --count K`. The one-command forms keep their "
    "meaning: `audit latest` and `audit --all --ray` audit screens, `audit --archive FILE` a file alone, "
    "`audit SCREEN --reexecute K` re-executes."))

OnRay = Annotated[bool, typer.Option("--ray", metavar="", help="Run the audits as Ray tasks (embedded, or --address).")]
# No envvar here: $PACKBENCH_RAY_ADDRESS is where screens run; an audit goes to a cluster only when told.
RayAddress = Annotated[Optional[str], typer.Option(help="Ray cluster to run on (implies --ray for audits).")]
Trust = Annotated[Optional[list[Path]], typer.Option(
    help="A trusted signer's public key file (repeatable). The archive's signature (ARCHIVE.sig) must be valid "
         "and by one of them; unsigned, unknown-signer and bad-signature archives never agree.")]
MaxMib = Annotated[Optional[int], typer.Option(
    min=1, max=1 << 20, help="Raise the archive size bounds (1 GiB file, 640 MiB of members) to this many MiB for a large "
                "archive you trust; the stated audit time and memory bound then no longer hold.")]
Screens = Annotated[Optional[list[str]], typer.Argument(help="Screen ids, or `latest`.")]
AllScreens = Annotated[bool, typer.Option("--all", metavar="", help="Every screen that ran.")]
Since = Annotated[Optional[str], typer.Option(help="Screens whose latest attempt started on or after this ISO "
                                                   "date/time (UTC).")]
ProtocolRef = Annotated[Optional[str], typer.Option(help="Screens of this protocol (name or SHA-256 prefix).")]
JsonLines = Annotated[bool, typer.Option("--json", metavar="", help="One JSON object per audit, one per line (JSON Lines).")]


def _trusted(trust: list[Path] | None):
    if not trust:
        return None
    from packbench.core.provenance import load_public_key

    return [load_public_key(p) for p in trust]


def _existing(path: Path) -> Path:
    kind = not_a_file(path)
    if kind == "missing":
        raise PackbenchError(f"no archive at {path}; check the path")
    if kind is not None:
        raise PackbenchError(f"{path} is {kind}, not an archive file; give a raw archive (.zip) written by packbench")
    return path


def _no_files(refs: list[str] | None) -> None:
    for ref in refs or []:
        if ref.endswith(".zip") or Path(ref).is_file():  # `report` takes a file here; audit's form says so
            raise PackbenchError(f"{ref!r} is not a screen id but a file; audit an archive file with "
                                 f"`packbench audit archive {ref}` (or --archive {ref})")


@audit_app.command("archive")
def audit_archive_cmd(
    ctx: typer.Context,
    files: Annotated[list[Path], typer.Argument(help="Archive files (.zip); no database is needed.")],
    trust: Trust = None,
    max_mib: MaxMib = None,
    on_ray: OnRay = False,
    address: RayAddress = None,
    json_out: JsonLines = False,
) -> None:
    """Audit archive files alone: every member's hash, the signature (--trust), every total and verdict.

    Exit codes: 0 every archive agrees; 1 one disagrees or its evidence is refused; 2 an archive that
    cannot be read (not a zip, over the bounds).
    """
    from packbench.service.audit import audit_file

    settings = settings_of(ctx, address=address)
    keys_trusted = _trusted(trust)
    outcomes = [audit_file(_existing(f), on_ray=on_ray or bool(address), settings=settings, trust=keys_trusted,
                           max_mib=max_mib) for f in files]
    _finish(outcomes, json_out=json_out)


@audit_app.command("screen")
def audit_screen_cmd(
    ctx: typer.Context,
    screens: Screens = None,
    all_screens: AllScreens = False,
    since: Since = None,
    protocol: ProtocolRef = None,
    archive: Annotated[Optional[Path], typer.Option(
        help="Audit this archive file as the one screen's (exactly one screen id).")] = None,
    on_ray: OnRay = False,
    address: RayAddress = None,
    concurrency: Annotated[int, typer.Option(min=1, max=1024, help="Audit tasks in flight at once (--ray).")] = 8,
    other_node: Annotated[Optional[bool], typer.Option(
        "--other-node/--any-node", help="Audit on a node other than the archive's producer (--ray; default: "
                                        "when the cluster has several nodes).")] = None,
    repeat: Annotated[int, typer.Option(min=1, max=1024, help="Audit each archive this many times on distinct nodes "
                                                    "(--ray); their digests must agree.")] = 1,
    max_mib: MaxMib = None,
    db: DbUrl = None,
    json_out: JsonLines = False,
) -> None:
    """Audit screens' latest attempts against the database and record each audit.

    Exit codes: 0 every audit agrees; 1 one disagrees, or repeated audits differ; 2 bad input or an
    archive that cannot be read; also 2 (after printing the result) when an audit could not be recorded.
    """
    from packbench.service.audit import audit_screens

    settings = settings_of(ctx, db_url=db, address=address)
    on_ray = on_ray or bool(address)
    store, ids = _select(settings, screens, archive, all_screens=all_screens, since=since, protocol=protocol)
    if not ids:
        typer.echo("no screens to audit", err=True)
        _empty(json_out)
        return
    bar = None
    if on_ray and not json_out:
        from packbench.cli.progress import steps

        bar = steps(f"auditing {len(ids)} screen(s) on the cluster", "audits")
    try:
        outcomes = audit_screens(store, ids, on_ray=on_ray, settings=settings, archive=archive,
                                 concurrency=concurrency, other_node=other_node, repeat=repeat, max_mib=max_mib,
                                 progress=bar)
    finally:
        if bar is not None:
            bar.close()
    from packbench.cli.query import signer_revocations

    _finish(outcomes, json_out=json_out, revoked=signer_revocations(store))


def _empty(json_out: bool) -> None:
    if json_out:  # a script reading stdout gets a document, not nothing
        typer.echo(json.dumps([]))


def _select(settings, screens, archive, *, all_screens, since, protocol):
    """(store, screen ids) of a database form; an archive file given with it belongs to one screen."""
    from packbench.cli.common import open_store
    from packbench.core.dates import parse_when
    from packbench.service.audit import select_screens

    _no_files(screens)
    if archive is not None:
        _existing(archive)
        if len(screens or []) != 1:
            raise PackbenchError("--archive with a database needs exactly one screen id (the archive's screen); "
                                 "an archive alone: `packbench audit archive FILE`")
    since_utc = None if since is None else parse_when(since, option="--since")  # a bad date before the database
    store = open_store(settings.db_url)
    return store, select_screens(store, screens or [], all_screens=all_screens, since=since_utc, protocol=protocol)


def _finish(outcomes, *, json_out: bool, revoked: dict | None = None) -> None:
    """Print every outcome; exit 2 for an unreadable archive, 1 for a disagreement, 2 for an unrecorded audit.
    `revoked`: when each revoked key of the database was revoked, by key id (`keys revoke`); None
    for archive files alone (no database: nothing known of revocations)."""
    from packbench.service.audit import repeat_disagreements

    for o in outcomes:
        _print_audit(o, json_out=json_out, detail=len(outcomes) == 1, revoked=revoked)
    differ = repeat_disagreements(outcomes)
    for line in differ:
        typer.echo(f"problem: {one_line(line)}", err=True)
    unrecorded = [o for o in outcomes if o.record_error is not None]
    for o in unrecorded:
        typer.echo(f"error: the audit of screen {o.screen_id} was not recorded: {o.record_error}", err=True)
    # An attempt that did not finish, with no archive or a consistent partial one, is reported as
    # such and decides no exit code: a failed screen does not fail every later `audit --all`.
    judged = [o for o in outcomes if not o.unfinished]
    if any(o.report is None or o.report.unreadable for o in judged):
        raise typer.Exit(2)
    if differ or not all(o.agrees for o in judged):
        raise typer.Exit(1)
    if unrecorded:
        raise typer.Exit(2)


@audit_app.command("reexecute")
def audit_reexecute_cmd(
    ctx: typer.Context,
    screens: Screens = None,
    count: Annotated[int, typer.Option(
        "--count", min=1, max=100_000, help="Re-run this many episodes drawn by --seed (at least one per condition) on a GPU "
                               "worker of the archive's accelerator type; logits, tokens and every ledger byte must "
                               "be equal, times and memory peaks within the tolerances of docs/archive.md.")] = 1,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1, help="Seed of the draw.")] = 0,
    time_factor: Annotated[Optional[float], typer.Option(
        callback=finite, help="How far (a factor either way) a condition's median episode wall may be from the archived one "
             "(default 2; recorded with the audit). Tiny CPU episodes are noise: widen it there.")] = None,
    archive: Annotated[Optional[Path], typer.Option(
        help="Re-execute this archive file: alone (no database), or as the one screen's.")] = None,
    model_dir: Annotated[Optional[Path], typer.Option(
        help="An archive whose checkpoint lies elsewhere here: the checkpoint directory (its content digest "
             "must equal the archived one).")] = None,
    trust: Trust = None,
    all_screens: AllScreens = False,
    since: Since = None,
    protocol: ProtocolRef = None,
    address: RayAddress = None,
    db: DbUrl = None,
    json_out: JsonLines = False,
) -> None:
    """Re-run drawn episodes on a worker and compare what they measure with the archive (the only
    check that the numbers are true); recorded as an audit of kind reexecute.

    Exit codes: 0 every re-execution agrees, or is partial (episodes whose archived placement this
    device cannot hold are named, not judged); 1 one disagrees; 2 bad input, an unreadable archive, or
    (after printing the result) a re-execution that could not be recorded.
    """
    from packbench.service.audit import reexecute_archive, reexecute_screens

    settings = settings_of(ctx, db_url=db, address=address)
    if trust and (archive is None or screens):
        raise PackbenchError("--trust checks the signature of one --archive file; give --archive without screen ids")
    if model_dir is not None and (archive is None or screens or all_screens or since or protocol):
        # A screen re-executes the checkpoint its row names: DIR would be dropped, silently.
        raise PackbenchError("--model-dir gives the checkpoint of one --archive file re-executed alone; a screen "
                             "re-executes the checkpoint its database row names (nothing was re-executed): give "
                             "--archive FILE without screen ids, or drop --model-dir")
    if model_dir is not None:  # its config is checked before episodes are drawn and a worker is asked for
        from packbench.engine.config import read_config

        read_config(model_dir)
    say = (lambda msg: None) if json_out else (lambda msg: typer.echo(msg, err=True))
    if archive is not None and not (screens or all_screens or since or protocol):
        static = _static_audit(_existing(archive), _trusted(trust))
        outcomes = [reexecute_archive(archive, k=count, seed=seed, settings=settings, static=static, progress=say,
                                      model_dir=None if model_dir is None else str(model_dir),
                                      time_factor=time_factor)]
    else:
        store, ids = _select(settings, screens, archive, all_screens=all_screens, since=since, protocol=protocol)
        if not ids:
            typer.echo("no screens to re-execute", err=True)
            _empty(json_out)
            return
        outcomes = reexecute_screens(store, ids, k=count, seed=seed, settings=settings, archive=archive,
                                     progress=say, time_factor=time_factor)
    for o in outcomes:
        _print_reexecution(o, seed=seed, json_out=json_out)
    for o in outcomes:
        if o.record_error is not None:
            typer.echo(f"error: the re-execution of screen {o.screen_id} was not recorded: {o.record_error}", err=True)
    if any(o.disagrees for o in outcomes):
        raise typer.Exit(1)
    if any(o.record_error is not None for o in outcomes):
        raise typer.Exit(2)


def _static_audit(archive: Path, trust):
    from packbench.core.audit import audit_archive

    static = audit_archive(archive, trust=trust)
    if static.unreadable:
        raise PackbenchError(f"{archive} is not an archive packbench can read: {static.problems[0]}")
    return static


def _print_reexecution(o, *, seed: int, json_out: bool) -> None:
    from packbench.service.audit import host_and_node

    if json_out:
        typer.echo(json.dumps({"screen_id": o.screen_id, "archive_path": str(o.archive_path), "node": o.node,
                               "host": o.host, "digest": o.digest, "medians": o.medians,
                               "seconds": o.seconds, "exact": "agree" if o.exact_agrees else "disagree",
                               "timing": "disagree" if o.timing_problems else "agree",
                               "busy_hosts": list(o.busy_hosts), **o.record}, sort_keys=True, default=str))
        return
    what = f"screen {o.screen_id}" if o.screen_id is not None else str(o.archive_path)
    for name, m in sorted(o.medians.items()):
        typer.echo(f"  {name:>16}: median wall {m['reexecuted_s'] * 1e3:9.2f} ms re-executed, "
                   f"{m['archived_s'] * 1e3:9.2f} ms archived")
    for p in o.problems:
        typer.echo(f"problem: {one_line(p)}")
    for line in o.unjudged:
        typer.echo(f"unjudged: {one_line(line)}")
    typer.echo(f"re-execution audit of {what}: {o.record['result'].upper()} ({reexecution_parts(o)}) (episodes "
               f"{', '.join(map(str, o.record['episodes']))}, seed {seed}, on {host_and_node(o.host, o.node)} "
               f"{o.record['accelerator'] or 'cpu'}, {o.seconds:.1f} s, digest {o.digest[:16]})")


def reexecution_parts(o) -> str:
    """The exact part and the timing part of a re-execution, each with its own answer; where only
    the timing disagrees, the option that widens its tolerance."""
    exact = ("exact part: logits, tokens and bytes all matched" if o.exact_agrees else
             f"exact part: {len(o.problems) - len(o.timing_problems)} difference(s) in logits, tokens, bytes or the "
             f"static audit")
    if o.record.get("placements") == "archived":
        exact += "; competitors re-ran their archived placements"
    unjudged = getattr(o, "unjudged", [])
    if unjudged:
        exact += (f"; {len(unjudged)} episode(s) not judged: their archived placement does not fit this "
                  f"device beside its context")
    factor = o.record.get("time_factor")
    if not o.timing_problems:
        return f"{exact}; timing part: medians within {factor:g}x"
    timing = (f"timing part: {len(o.timing_problems)} condition(s)' median wall outside {factor:g}x")
    if o.exact_agrees:
        timing += "; only the times disagree: on a noisy or shared host widen it with --time-factor"
    busy = getattr(o, "busy_hosts", ())
    return f"{exact}; {timing}" + (f"; {'; '.join(busy)}" if busy else "")


def _signature_json(sig: dict | None, revoked: dict | None) -> dict:
    """{"signature": ...} as --json prints it, or {} to keep the record's: in a database's audit
    (`revoked` given) the signature also carries `revoked_at`, when its key was revoked (`keys
    revoke`; ISO 8601 UTC, None while in force). The result stays the archive's: a revocation is
    about trust from then on, not about bytes sealed before it; the record (and its digest) is
    left as the audit computed it."""
    if sig is None or revoked is None:
        return {}
    when = revoked.get(sig.get("key_id"))
    return {"signature": {**sig, "revoked_at": None if when is None else when.isoformat()}}


def _print_audit(o, *, json_out: bool, detail: bool, revoked: dict | None) -> None:
    what = f"screen {o.screen_id}" if o.screen_id is not None else str(o.archive_path)
    if o.no_archive is not None:
        if json_out:
            typer.echo(json.dumps({"screen_id": o.screen_id, "attempt": o.attempt_number, "result": "no-archive",
                                   "archive_path": str(o.archive_path), "reason": o.no_archive}, sort_keys=True))
        else:
            typer.echo(f"audit of {what}: NO ARCHIVE ({one_line(o.no_archive)})")
        return
    if o.report is None:
        typer.echo(f"error: audit of {what}: {o.error}", err=True)
        return
    report = o.report

    def named(problem: str) -> str:  # a file's audit: the command a line suggests names the file itself
        if o.screen_id is not None:
            return problem
        return problem.replace("`packbench audit archive FILE ", f"`packbench audit archive {shlex.quote(str(o.archive_path))} ")

    if getattr(report, "unreadable", False) and not json_out and report.record.get("archive_sha256") is None:
        # over the file bound, never hashed: the line names its size, the bound and `--max-mib`
        typer.echo(f"error: audit of {what}: {one_line(named(report.problems[0]))}", err=True)
        return
    if getattr(report, "unreadable", False) and not json_out:  # not an archive: one line, no empty verdict table
        typer.echo(f"error: {what} is not an archive packbench can read: {one_line(report.problems[0])}", err=True)
        return
    if o.unfinished and not json_out:
        held = ("each as the database holds it" if not report.rows_pending
                else "some without a row yet (`packbench db reconcile` inserts them)" if not report.record["complete"]
                # sealed: the dispatcher stopped before it stored the verdicts (and perhaps rows)
                else "the archive sealed, rows of it not in the database yet (`packbench db reconcile` inserts them)")
        typer.echo(f"audit of {what}: PARTIAL (attempt {o.attempt_number} {o.attempt_status}: "
                   f"{report.record['episodes']} of {report.record['planned']} planned episodes archived, "
                   f"{held}; digest {report.digest[:16]}, on {o.where})")
        return
    if json_out:
        typer.echo(json.dumps({"screen_id": o.screen_id, "attempt": o.attempt_number, "archive_path": str(o.archive_path),
                               "node": o.node, "host": o.host, "digest": report.digest, **report.record,
                               **_signature_json(report.record.get("signature"), revoked),
                               "result": o.result, **({"partial": True} if o.unfinished else {})},
                              sort_keys=True, default=str))
        return
    if detail:
        from packbench.core.audit import detail_key

        # with each recomputed verdict's detail: which way a fidelity bound compares, why one failed
        typer.echo(verdict_table([{**v, "detail": report.details.get(detail_key(v)), "tier": report.tiers.get(v["condition"])}
                                  for v in report.record["verdicts"]]))
        for p in report.problems:
            typer.echo(f"problem: {one_line(named(p))}")
    elif report.problems:
        typer.echo(f"problem: {what}: {one_line(named(report.problems[0]))}" + (f" (+{len(report.problems) - 1} more)"
                                                              if len(report.problems) > 1 else ""))
    sig = report.record.get("signature")
    if sig is not None and sig["status"] == "valid" and sig["key_id"] in (revoked or {}):
        # the database's key, revoked since: "by trusted key" read as if `keys revoke` had not been run
        typer.echo(f"signature: valid, by key {sig['key_id']}, REVOKED at {revoked[sig['key_id']]:%Y-%m-%d %H:%M} "
                   f"UTC (anyone holding the key may have sealed it: it proves nothing about where)")
    elif sig is not None and sig["status"] == "valid":
        typer.echo(f"signature: valid, by trusted key {sig['key_id']} (proves where it was sealed, not that the "
                   f"numbers are true)")
    # An attempt the database does not call done (lost, interrupted, failed, still running): a
    # sealed archive of one agrees when its dispatcher stopped after the seal. Said, so that an
    # AGREE and a table of passing verdicts are not read as a done screen's.
    ended = (f"attempt {o.attempt_number} {o.attempt_status} in the database, not done; "
             if o.attempt_status not in (None, "done") else "")
    typer.echo(f"audit of {what}: {report.record['result'].upper()} "
               f"({ended}{report.record['episodes']} episodes, digest {report.digest[:16]}, on {o.where})")


def register(app: typer.Typer) -> None:
    app.add_typer(audit_app, name="audit")
