"""`packbench ingest`: bring an archive made elsewhere into this database, if it audits."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from packbench.cli.common import DbUrl, Json, echo_json, open_store


def ingest(
    archive: Annotated[Path, typer.Argument(help="A sealed raw archive (its signature: ARCHIVE.sig).")],
    trust: Annotated[Optional[list[Path]], typer.Option(
        help="A trusted signer's public key file (repeatable); registered keys are trusted too.")] = None,
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Audit an archive from another machine or lab; if it agrees and is signed by a trusted
    key, record its screen, attempt, episodes, verdicts and machine (marked as ingested).

    Exit codes: 0 ingested; 1 refused (disagrees, incomplete, unsigned, untrusted signer, or
    already here; nothing written); 2 bad input (no such file, unreadable key).
    """
    from packbench.core.errors import PackbenchError
    from packbench.service.ingest import ingest as run

    if not archive.is_file():
        raise PackbenchError(f"no archive at {archive}; check the path")
    outcome = run(open_store(db), archive, trust_files=list(trust or []))
    if outcome.report.unreadable:
        typer.echo(f"error: {outcome.reasons[0] if outcome.reasons else 'unreadable archive'}", err=True)
        raise typer.Exit(2)
    sig = outcome.report.record.get("signature", {})
    if json_out:
        echo_json({"archive": str(archive), "ingested": outcome.ingested, "reasons": list(outcome.reasons),
                   "screen_id": outcome.screen_id, "attempt_id": outcome.attempt_id,
                   "episodes": outcome.report.record.get("episodes"), "key_id": sig.get("key_id"),
                   "registered": outcome.registered is not None})
    if not outcome.ingested:
        if json_out:
            typer.echo(f"refused {archive}: nothing was written", err=True)
            raise typer.Exit(1)
        for line in outcome.reasons:
            typer.echo(f"problem: {line}")
        typer.echo(f"refused {archive}: nothing was written", err=True)
        raise typer.Exit(1)
    if json_out:
        return
    typer.echo(f"ingested {archive} as screen {outcome.screen_id} (attempt {outcome.attempt_number}), "
               f"{outcome.report.record['episodes']} episodes, signed by {sig.get('key_id')}")
    if outcome.registered:
        typer.echo(f"registered key {outcome.registered} (given with --trust) as a trusted signer here: later "
                   f"audits of the screen check its signature against it, and ingest trusts it from now on")


def register(app: typer.Typer) -> None:
    app.command()(ingest)
