"""packbench: submit frozen protocol screens to Ray GPU workers, query results, audit archives."""

import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.common import ArchiveDir, DbUrl, Json, open_store
from cli.summary import episode_dicts, print_json, screen_summary, verdict_dicts, verdict_table
from core.errors import PackbenchError
from core.registry import DTYPE_NAMES, SYNTH_SHAPES, SynthArgumentError, synth_spec

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help=__doc__)
model_app = typer.Typer(no_args_is_help=True, help="Synthetic checkpoints.")
db_app = typer.Typer(no_args_is_help=True, help="The results database: migrations.")
app.add_typer(model_app, name="model")
app.add_typer(db_app, name="db")

from cli import query  # noqa: E402  (after the apps it registers on)

query.register(app)


@model_app.command("synth")
def model_synth(
    out: Annotated[Path, typer.Option(help="Output directory (Hugging Face layout).")],
    shape: Annotated[str, typer.Option(help=f"One of {', '.join(SYNTH_SHAPES)}.")] = "tiny",
    dtype: Annotated[str, typer.Option(help=f"One of {', '.join(DTYPE_NAMES)}.")] = "float32",
    sparsity: Annotated[float, typer.Option(help="Fraction of post-ReLU activations that are exactly zero, in (0, 1).")] = 0.94,
    seed: Annotated[int, typer.Option(help="Weights are a pure function of the seed (>= 0).")] = 0,
    hot_fraction: Annotated[float, typer.Option(help="Fraction of neurons per layer that fire far more often, in [0, 1).")] = 0.0,
    hot_bias: Annotated[float, typer.Option(help="Their fc1 bias in units of std*sqrt(hidden), finite (0.0: ~50% active).")] = 0.0,
    force: Annotated[bool, typer.Option(help="Replace a checkpoint already in --out.")] = False,
) -> None:
    """Write a synthetic OPT checkpoint with real OPT shapes and a chosen activation sparsity."""
    try:  # the same check a protocol's model.synth gets, before torch is imported
        synth_spec(shape=shape, dtype=dtype, sparsity=sparsity, seed=seed, hot_fraction=hot_fraction,
                   hot_bias=hot_bias)
    except SynthArgumentError as e:
        raise PackbenchError(e.line("--" + e.arg.replace("_", "-"))) from None
    from engine.synth import synth_checkpoint

    path = synth_checkpoint(out, shape=shape, dtype=dtype, sparsity=sparsity, seed=seed,
                            hot_fraction=hot_fraction, hot_bias=hot_bias, force=force)
    typer.echo(f"wrote {shape} {dtype} checkpoint (sparsity {sparsity}, seed {seed}) to {path}")


@db_app.command("upgrade")
def db_upgrade(db: DbUrl = None) -> None:
    """Create or migrate the database to the newest schema."""
    store = open_store(db, at_head=False)
    store.upgrade()
    typer.echo(f"database at {store.current()} (head)")


@db_app.command("current")
def db_current(db: DbUrl = None) -> None:
    """Print the database's schema revision."""
    store = open_store(db, at_head=False)
    current, head = store.current(), store.head()
    typer.echo(f"{current or 'empty'}{' (head)' if current == head else f' (head is {head}: run `packbench db upgrade`)'}")


@db_app.command("history")
def db_history(db: DbUrl = None) -> None:
    """List the schema revisions, newest first."""
    for line in open_store(db, at_head=False).history():
        typer.echo(line)


@app.command()
def submit(
    protocol: Annotated[Path, typer.Argument(help="Protocol YAML file.")],
    wait: Annotated[bool, typer.Option("--wait", help="Run the screen now and wait for its verdicts.")] = False,
    address: Annotated[Optional[str], typer.Option(help="Join this Ray cluster instead of an embedded local one.")] = None,
    archive_dir: ArchiveDir = Path("archives"),
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Freeze a protocol and queue a screen; with --wait, run it on a GPU worker actor now."""
    store = open_store(db)  # refuse an old database before importing the engine
    from cluster.submit import enqueue

    screen_id = enqueue(store, protocol)
    if not wait:
        typer.echo(f"queued screen {screen_id}; run it with `packbench dispatch`")
        return
    _run(store, screen_id, archive_dir=archive_dir, address=address, json_out=json_out)


@app.command()
def dispatch(
    address: Annotated[Optional[str], typer.Option(help="Join this Ray cluster instead of an embedded local one.")] = None,
    archive_dir: ArchiveDir = Path("archives"),
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Run every queued screen, oldest first."""
    store = open_store(db)
    queued = store.queued_screens()
    if not queued:
        typer.echo("no queued screens")
    for screen in queued:
        _run(store, screen.id, archive_dir=archive_dir, address=address, json_out=json_out)


def _run(store, screen_id: int, *, archive_dir: Path, address: str | None, json_out: bool) -> None:
    from cluster.screen import run_screen

    progress = (lambda msg: None) if json_out else typer.echo
    outcome = run_screen(store, screen_id, archive_dir=archive_dir, address=address, progress=progress)
    summary = screen_summary(store, screen_id)
    if json_out:
        print_json(summary)
    else:
        typer.echo(verdict_table(summary["verdicts"]) if summary["verdicts"] else "no verdicts")
        typer.echo(f"archive: {outcome.archive_path}")
    if outcome.status != "done":
        typer.echo(f"error: screen {screen_id} failed: {outcome.error}", err=True)
        raise typer.Exit(1)


@app.command()
def audit(
    screen: Annotated[Optional[str], typer.Argument(help="Screen id, or `latest`.")] = None,
    archive: Annotated[Optional[Path], typer.Option(help="Audit this archive file (without a screen id: no database needed).")] = None,
    on_ray: Annotated[bool, typer.Option("--ray", help="Run the audit as a Ray task (embedded, or --address).")] = False,
    address: Annotated[Optional[str], typer.Option(help="Ray cluster to run the audit on (implies --ray).")] = None,
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Re-read a raw archive, recompute every metric and verdict, compare with the database."""
    import platform

    from core.audit import audit_archive

    if screen is None and archive is None:
        raise PackbenchError("give a screen id (or `latest`), or --archive FILE to audit an archive alone")
    compare: dict = {}
    store = row = attempt = None
    if screen is not None:
        store = open_store(db)
        row = store.screen(screen)
        attempt = store.latest_attempt(row.id)
        if attempt is None:
            raise PackbenchError(f"screen {row.id} has not run yet; run `packbench dispatch` first")
        compare = dict(expected_sha256=attempt.archive_sha256, db_verdicts=verdict_dicts(store.verdicts(attempt.id)),
                       db_episodes=episode_dicts(store.episodes(attempt.id)))
    path = Path(archive or attempt.archive_path)
    started = datetime.now(timezone.utc)
    if on_ray or address:
        from cluster.audit import audit_on_cluster

        report = audit_on_cluster(path, address=address, **compare)
    else:
        report = audit_archive(path, **compare)
    if store is not None:
        store.put_audit(attempt_id=attempt.id, archive_sha256=report.record["archive_sha256"], digest=report.digest,
                        result=report.record["result"], problems=report.problems, machine=platform.node(),
                        started_at=started, finished_at=datetime.now(timezone.utc))
    what = f"screen {row.id}" if row is not None else str(path)
    if json_out:
        print_json({"screen_id": None if row is None else row.id, "attempt": None if attempt is None else attempt.number,
                    "archive_path": str(path), "digest": report.digest, **report.record})
    else:
        typer.echo(verdict_table(report.record["verdicts"]))
        for p in report.problems:
            typer.echo(f"problem: {p}")
        typer.echo(f"audit of {what}: {report.record['result'].upper()} "
                   f"({report.record['episodes']} episodes, digest {report.digest[:16]})")
    if not report.agrees:
        raise typer.Exit(1)


def main() -> None:
    """Console entry point: user errors print one line and exit 2, never a traceback."""
    try:
        app()
    except PackbenchError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted; the attempt is recorded as interrupted", err=True)
        sys.exit(130)
