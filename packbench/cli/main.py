"""packbench: submit frozen protocol screens to Ray GPU workers, query results, audit archives."""

import dataclasses
import errno
import json
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from packbench.cli import (audit_cmd, history, ingest, keys, labels, model_moe, model_stats, protocol_cmd, query, report,
                           simulate_cmd)
from packbench.cli.common import (DB_HELP, DB_INT_MAX, DB_INT_MIN, Address, ArchiveDir, DbUrl, Json,
                                  top_db, echo_json, open_store, seconds, output_dir, settings_of)
from packbench.cli.summary import screen_summary, verdict_table
from packbench.core import signals
from packbench.core.errors import ClusterUnreachable, PackbenchError
from packbench.core.settings import (DB_URL_ENV, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_EPISODE_TIMEOUT_S,
                                     DEFAULT_LOAD_TIMEOUT_S, DEFAULT_PLACEMENT_TIMEOUT_S, ENVIRONMENT, WORKER_PIN_ENV,
                                     WORKER_THREADS_ENV, Settings, worker_pin, worker_threads)
from packbench.core.moe import MOE_SHAPES
from packbench.core.registry import NEWEST_PROFILE, DTYPE_NAMES, PROFILES, SYNTH_SHAPES, SynthArgumentError, synth_spec
from packbench.core.text import error_line, one_line, show


class PackbenchGroup(TyperGroup):
    """The top-level group: with --debug, an error's traceback is printed (here, where the
    settings are known) before `main` prints its one line."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # an exit code, or a usage error: no traceback to show
        except KeyboardInterrupt:
            # SIGINT, or SIGTERM once Ray is up (core/signals.py), that no command caught: typer would
            # make it a bare exit 130 (an `audit reexecute` stopped so said nothing, even for SIGTERM).
            typer.echo(signals.stop_line(), err=True)
            raise typer.Exit(signals.exit_code()) from None
        except Exception:  # bad input (PackbenchError) or a bug: `main` prints the one line
            if isinstance(ctx.obj, Settings) and ctx.obj.debug:
                traceback.print_exc()
            raise


ENVIRONMENT_EPILOG = "Environment variables (each sets its option): " + "; ".join(
    f"{name} ({option})" for name, (option, _) in ENVIRONMENT.items()) + "."

app = typer.Typer(cls=PackbenchGroup, no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  help=__doc__, epilog=ENVIRONMENT_EPILOG)
model_app = typer.Typer(no_args_is_help=True, help="Synthetic checkpoints.")
db_app = typer.Typer(no_args_is_help=True, help="The results database: migrations, reconciliation with the archives.")
app.add_typer(model_app, name="model")
app.add_typer(db_app, name="db")


@model_app.command("synth")
def model_synth(
    out: Annotated[Path, typer.Option(help="Output directory (Hugging Face layout).")],
    shape: Annotated[str, typer.Option(help=f"One of {', '.join(SYNTH_SHAPES)}; MoE: {', '.join(MOE_SHAPES)}.",
                                       autocompletion=lambda: [*SYNTH_SHAPES, *MOE_SHAPES])] = "tiny",
    dtype: Annotated[str, typer.Option(help=f"One of {', '.join(DTYPE_NAMES)}.",
                                       autocompletion=lambda: list(DTYPE_NAMES))] = "float32",
    profile: Annotated[Optional[str], typer.Option(
        help=f"A calibrated recipe whose activation statistics match real OPT (docs/workloads.md): "
             f"{', '.join(PROFILES)}. The default, unless --sparsity is given.",
        autocompletion=lambda: list(PROFILES))] = None,
    sparsity: Annotated[Optional[float], typer.Option(
        help="The uniform recipe instead of a profile: fraction of post-ReLU activations exactly zero, in (0, 1), "
             "alike for every neuron.")] = None,
    seed: Annotated[int, typer.Option(help="Weights are a pure function of the seed (>= 0).")] = 0,
    hot_fraction: Annotated[Optional[float], typer.Option(
        help="Uniform recipe: fraction of neurons per layer that fire far more often, in [0, 1).")] = None,
    hot_bias: Annotated[Optional[float], typer.Option(
        help="Uniform recipe: their fc1 bias in units of std*sqrt(hidden), finite (0.0: ~50% active).")] = None,
    force: Annotated[bool, typer.Option(metavar="", help="Replace a checkpoint already in --out.")] = False,
    layers: Annotated[Optional[int], typer.Option(
        help="MoE shapes: the real layer shapes with fewer layers (default: the shape's depth).")] = None,
    device: Annotated[str, typer.Option(help="MoE shapes: where the weights are drawn (cpu, cuda[:N]).")] = "cpu",
    routing: Annotated[Optional[str], typer.Option(
        help="MoE shapes: the routing profile (a protocol's model.synth.routing; --profile says the same).")] = None,
    json_out: Json = False,
) -> None:
    """Write a synthetic checkpoint with real shapes: OPT (a calibrated profile, or a uniform sparsity) or an
    MoE family (Mixtral, Qwen3-MoE, OLMoE) with routing calibrated to published figures."""
    if shape in MOE_SHAPES:
        if routing is not None and profile is not None and routing != profile:
            raise PackbenchError(f"--routing {routing} and --profile {profile} name two routing profiles; give one")
        profile = routing if routing is not None else profile
        if sparsity is not None or hot_fraction is not None or hot_bias is not None:
            raise PackbenchError(f"--sparsity, --hot-fraction and --hot-bias are OPT recipes; {shape} is an MoE shape "
                                 f"(give --routing {' or '.join(model_moe.ROUTING_PROFILES)}, or none)")
        if dtype not in DTYPE_NAMES:
            raise PackbenchError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
        model_moe.check_synth(shape=shape, profile=profile, layers=layers, device=device)
        output_dir(out, "--out") if not force else None
        model_moe.synth(out, shape=shape, dtype=dtype, seed=seed, profile=profile, layers=layers, device=device,
                        json_out=json_out)
        return
    if layers is not None or device != "cpu" or routing is not None:
        raise PackbenchError(f"--layers, --device and --routing are for MoE shapes ({', '.join(MOE_SHAPES)}); drop them for {shape}")
    if profile is None and sparsity is None:
        profile = NEWEST_PROFILE  # what a protocol of the newest schema means (core/protocol/schema.py)
    try:  # the same check a protocol's model.synth gets, before torch is imported
        spec = synth_spec(shape=shape, dtype=dtype, sparsity=sparsity, seed=seed, hot_fraction=hot_fraction,
                          hot_bias=hot_bias, profile=profile)
    except SynthArgumentError as e:
        raise PackbenchError(e.line("--" + e.arg.replace("_", "-"))) from None
    output_dir(out, "--out")  # before the weights are drawn, which takes minutes for a large shape
    from packbench.cli.progress import steps
    from packbench.engine.synth import synth_checkpoint

    progress = steps(f"synthesising {shape} {dtype}", "layers", after="writing model.safetensors", quiet=json_out)
    try:
        path = synth_checkpoint(out, **spec, force=force, progress=progress)
    except OSError as e:  # a full disk while writing model.safetensors, say
        raise PackbenchError(f"--out {out}: cannot write the checkpoint ({e.strerror or type(e).__name__}); "
                             f"free space or choose another --out") from None
    finally:
        progress.close()
    if json_out:
        echo_json({"path": str(path), "shape": shape, "dtype": dtype, "profile": profile, "sparsity": sparsity,
                   "seed": seed})
        return
    recipe = f"profile {profile}" if profile else f"sparsity {sparsity}"
    typer.echo(f"wrote {shape} {dtype} checkpoint ({recipe}, seed {seed}) to {path}")


@model_app.command("digest")
def model_digest(
    model_dir: Annotated[Path, typer.Argument(help="A local checkpoint directory.")],
    json_out: Json = False,
) -> None:
    """Print a checkpoint's content digest, to pin it in a protocol as model: {path, sha256}."""
    from packbench.core.provenance import checkpoint_digest

    if not model_dir.is_dir():
        raise PackbenchError(f"no checkpoint directory at {model_dir}; give the folder holding config.json")
    if not (model_dir / "config.json").is_file():
        raise PackbenchError(f"{model_dir} is a directory without config.json, not a checkpoint; give the folder "
                             f"holding config.json")
    digest = checkpoint_digest(model_dir)
    typer.echo(json.dumps({"path": str(model_dir), "sha256": digest}) if json_out else digest)


@db_app.command("upgrade")
def db_upgrade(db: DbUrl = None, json_out: Json = False) -> None:
    """Create or migrate the database to the newest schema."""
    store = open_store(db, at_head=False)
    before = store.upgrade()  # read under the migration lock: another upgrade may have just run
    if json_out:
        typer.echo(json.dumps({"revision": store.current(), "head": store.head(), "from": before}, sort_keys=True))
        return
    typer.echo(f"database at {store.current()} (head)")


@db_app.command("reconcile")
def db_reconcile(db: DbUrl = None, json_out: Json = False) -> None:
    """Insert the rows of archived episodes the database lacks (after a database outage).

    Every attempt that is not running, or runs for a dispatcher on this host whose process is
    gone (a one-shot dispatch that stopped in an outage), and whose archive is on this host: each episode the
    archive holds without a row is checked against the archive's SHA-256 manifest entry (an
    unsealed archive: its zip CRC-32s) and inserted; rows already there are kept. A sealed
    archive's verdicts are inserted the same way when the database holds none of them (its
    dispatcher stopped between the seal and the verdicts). Exit 1 when an archived episode was
    refused (it is named)."""
    from packbench.service.reconcile import reconcile

    report = reconcile(open_store(db))
    if json_out:
        typer.echo(json.dumps({"checked": report.checked, "inserted": report.inserted, "refused": report.refused,
                               "verdicts": report.verdicts, "attempts": [dataclasses.asdict(r) for r in report.attempts],
                               "not_here": report.not_here}, sort_keys=True))
    else:
        for r in report.attempts:
            typer.echo(one_line(r.line()))
        # Not here: on another host, or never written (an attempt claimed and stopped before its first episode).
        missing = len(report.not_here)
        elsewhere = (f"; {missing} archive{'s' if missing != 1 else ''} not found here (on another host, or never "
                     f"written)") if missing else ""
        verdicts = f" and {report.verdicts} verdict row{'s' if report.verdicts != 1 else ''}" if report.verdicts else ""
        typer.echo(f"reconciled {report.inserted} episode row{'s' if report.inserted != 1 else ''}{verdicts} from "
                   f"{report.checked} archive{'s' if report.checked != 1 else ''}{elsewhere}"
                   + (f"; {report.refused} refused" if report.refused else ""))
    if report.refused:
        raise typer.Exit(1)


@db_app.command("current")
def db_current(db: DbUrl = None, json_out: Json = False) -> None:
    """Print the database's schema revision."""
    store = open_store(db, at_head=False, must_exist=True)  # a read: it creates no empty file
    current, head = store.current(), store.head()
    if json_out:
        echo_json({"revision": current, "head": head, "at_head": current == head})
        return
    if current is not None and current != head and not store.knows(current):
        # Before, a revision newer than this packbench's was told to run `db upgrade`, which refuses it.
        typer.echo(f"{current} (unknown to this packbench, whose newest is {head}: a newer packbench wrote it; "
                   f"install that version)")
        return
    from packbench.cli.common import db_setting
    from packbench.db.session import upgrade_command

    upgrade = upgrade_command(store.url, setting=db_setting())
    typer.echo(f"{current or 'empty'}{' (head)' if current == head else f' (head is {head}: run {upgrade})'}")


@db_app.command("history")
def db_history(db: DbUrl = None, json_out: Json = False) -> None:
    """List the schema revisions, newest first."""
    from packbench.db.store import Store

    lines = Store.history()  # the shipped revisions: no database is opened (nor an empty file created)
    if json_out:
        echo_json({"revisions": list(lines)})
        return
    for line in lines:
        typer.echo(line)


def _print_version(value: bool) -> None:
    if value:
        from importlib import metadata

        try:
            version = metadata.version("packbench")
        except metadata.PackageNotFoundError:
            version = "unknown (not installed: pip install -e .)"
        typer.echo(f"packbench {version}")
        raise typer.Exit()


@app.callback()
def options(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", metavar="", callback=_print_version, is_eager=True,
                                          help="Print packbench's version and exit.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", metavar="", envvar="PACKBENCH_VERBOSE",
                                          help="Log events, and let worker logs reach this terminal.")] = False,
    placement_timeout: Annotated[float, typer.Option(
        callback=seconds, envvar="PACKBENCH_PLACEMENT_TIMEOUT_S", help="Seconds a GPU worker may stay unplaced.")] = DEFAULT_PLACEMENT_TIMEOUT_S,
    connect_timeout: Annotated[float, typer.Option(
        callback=seconds, envvar="PACKBENCH_CONNECT_TIMEOUT_S", help="Seconds joining a Ray cluster (--address) may take.")] = DEFAULT_CONNECT_TIMEOUT_S,
    episode_timeout: Annotated[float, typer.Option(
        callback=seconds, envvar="PACKBENCH_EPISODE_TIMEOUT_S",
        help="Seconds an episode may run before its worker is taken as hung: the attempt fails (timed "
             "out), the worker is killed and replaced, the screen runs again while it has attempts left.")] = DEFAULT_EPISODE_TIMEOUT_S,
    load_timeout: Annotated[float, typer.Option(
        callback=seconds, envvar="PACKBENCH_LOAD_TIMEOUT_S",
        help="Seconds a screen's model load may take before its worker is taken as hung (as --episode-timeout)."
    )] = DEFAULT_LOAD_TIMEOUT_S,
    embedded_gpus: Annotated[Optional[int], typer.Option(
        min=1, max=1024, envvar="PACKBENCH_EMBEDDED_GPUS",
        help="GPUs the embedded Ray declares (default: the host's; one logical GPU on a CPU-only machine).")] = None,
    model_cache: Annotated[Optional[Path], typer.Option(
        envvar="PACKBENCH_MODEL_CACHE", help="Where workers generate synthetic checkpoints "
                                             "(default ~/.cache/packbench/models on each node).")] = None,
    signing_key: Annotated[Optional[Path], typer.Option(
        envvar="PACKBENCH_SIGNING_KEY", help="Ed25519 private key (`packbench keys init`) that signs every "
                                             "sealed archive (ARCHIVE.sig).")] = None,
    debug: Annotated[bool, typer.Option("--debug", metavar="", envvar="PACKBENCH_DEBUG",
                                        help="On an error, print its traceback before the one-line message.")] = False,
    db: Annotated[Optional[str], typer.Option("--db", envvar=DB_URL_ENV, callback=top_db, help=DB_HELP)] = None,
    threads: Annotated[Optional[str], typer.Option(
        "--worker-threads", envvar=WORKER_THREADS_ENV, show_default=False,
        help="Host threads of each GPU worker's gathers, or of a CPU worker's arithmetic (default: its share "
             "of the host's cores).")] = None,
    pin: Annotated[Optional[str], typer.Option(
        "--worker-pin", envvar=WORKER_PIN_ENV, show_default=False,
        help="1: pin each GPU worker to its GPU's share of the host's cores; 0 (default): do not.")] = None,
) -> None:
    """Settings shared by every command, read once (each names its environment variable)."""
    if placement_timeout <= 0 or connect_timeout <= 0:
        raise PackbenchError("--placement-timeout and --connect-timeout must be > 0 seconds")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        # transformers imports torchao with an MoE model where it is installed; torchao logs a WARNING
        # for each CUDA kernel library a CPU build cannot load and for a missing Triton, and torch one
        # per deprecated Enum registration: six lines of noise above `model stats`' own (--verbose shows them).
        for name in ("torchao", "torch.utils._pytree"):
            logging.getLogger(name).setLevel(logging.ERROR)
    def typed(name: str, option: str) -> str | None:  # the option, when the command line gave it
        return option if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE" else None

    ctx.obj = Settings(verbose=verbose, placement_timeout_s=placement_timeout, connect_timeout_s=connect_timeout,
                       episode_timeout_s=episode_timeout, load_timeout_s=load_timeout,
                       model_cache=model_cache, embedded_gpus=embedded_gpus, db_url=db or None, debug=debug,
                       signing_key=signing_key.expanduser() if signing_key else None,
                       worker_threads=worker_threads(threads, typed("threads", "--worker-threads")),
                       worker_pin=worker_pin(pin, typed("pin", "--worker-pin")))


@app.command()
def submit(
    ctx: typer.Context,
    protocol: Annotated[Path, typer.Argument(help="Protocol YAML file.")],
    wait: Annotated[bool, typer.Option("--wait", metavar="", show_default=False, help="Run the screen now (this command claims it) and wait for "
                                                      "its verdicts.")] = False,
    priority: Annotated[int, typer.Option(min=DB_INT_MIN, max=DB_INT_MAX,
                                          help="Higher runs first; FIFO within a priority.")] = 0,
    max_attempts: Annotated[int, typer.Option(min=1, max=DB_INT_MAX, help="Claims before a screen whose workers keep dying or "
                                                          "whose leases keep expiring is failed.")] = 3,
    gpu_type: Annotated[Optional[str], typer.Option(help="Only a worker with this GPU type (Ray's accelerator_type, "
                                                         "e.g. H200) may run it; overrides placement.accelerator_type.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="Queue this many screens of the protocol.")] = 1,
    spread: Annotated[bool, typer.Option("--spread", metavar="", help="Run the replicas on distinct nodes.")] = False,
    keep_queued: Annotated[bool, typer.Option(
        "--keep-queued", metavar="", help="With --wait: an interrupted (Ctrl-C) screen stays queued for the next `packbench "
                              "dispatch` instead of being cancelled.")] = False,
    name: labels.Name = None,
    tag: Annotated[Optional[list[str]], typer.Option("--tag", help="KEY=VALUE label, repeatable.")] = None,
    note: labels.Note = None,
    sweep: Annotated[Optional[list[str]], typer.Option(
        "--sweep", help="FIELD=V1,V2,...: one protocol per value (repeatable: their product), queued under one "
                        "sweep id; FIELD is a dotted protocol path, e.g. prefix_tokens.")] = None,
    address: Address = None,
    archive_dir: ArchiveDir = Path("archives"),
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Freeze a protocol and queue a screen; with --wait, run it on a GPU worker actor now.

    Exit codes with --wait: 0 the screen is done, every episode ok and every verdict passed; 1 a
    verdict or an episode failed, or the screen failed (every episode failed); 2 bad input (one line says which and how to fix it); 130/143 interrupted
    (SIGINT/SIGTERM): the screen is cancelled, its interrupted attempt kept, and with --sweep the
    points not yet run are cancelled too (--keep-queued: all stay queued instead).
    """
    settings = settings_of(ctx, db_url=db, address=address, archive_dir=archive_dir)
    store = open_store(settings.db_url)  # refuse an old database before anything else
    from packbench.service.submit import submit as queue_screens

    if keep_queued and not wait:
        raise PackbenchError("--keep-queued says what an interrupted --wait leaves behind; without --wait the "
                             "screen is only queued (nothing was queued): add --wait, or drop --keep-queued")
    if wait and replicas > 1:
        raise PackbenchError("--wait runs one screen; queue replicas without --wait and run `packbench dispatch`")
    if sweep and (replicas > 1 or spread):
        raise PackbenchError("--sweep queues one screen per point; drop --replicas/--spread, or repeat the sweep")
    if spread and replicas < 2:
        raise PackbenchError("--spread places replicas on distinct nodes; give --replicas 2 or more")
    source = ctx.get_parameter_source("address")
    if address and not wait and getattr(source, "name", None) == "COMMANDLINE":  # PACKBENCH_RAY_ADDRESS: no word
        raise PackbenchError(f"--address {address} joins a cluster to run the screen, and without --wait submit only "
                             f"queues it (nothing was queued); add --wait, or drop --address and run `packbench "
                             f"dispatch --address {address}`")
    if not wait and getattr(ctx.get_parameter_source("archive_dir"), "name", None) == "COMMANDLINE":
        raise PackbenchError(f"--archive-dir {archive_dir} says where --wait writes the screen's archive, and without "
                             f"--wait submit only queues it (nothing was queued): the dispatcher that runs it writes "
                             f"under its own; add --wait, or drop --archive-dir and run `packbench dispatch "
                             f"--archive-dir {archive_dir}`")
    if wait:
        output_dir(settings.archive_dir, "--archive-dir")  # before a screen is queued
        if settings.signing_key is not None:  # an unreadable key fails here, not after queuing the screen
            from packbench.core.provenance import Signer
            from packbench.service.dispatcher.rules import revoked_key_refusal

            refusal = revoked_key_refusal(Signer.load(settings.signing_key).key_id, settings.signing_key,
                                          store.signers())
            if refusal is not None:
                raise PackbenchError(refusal)
    if wait and settings.address:
        from packbench.cluster.runtime import ensure_ray

        ensure_ray(settings)  # an unreachable cluster fails here, before a screen is queued
    if sweep:
        from packbench.cli.sweep import submit_sweep

        submit_sweep(store, settings, protocol, sweep, wait=wait, json_out=json_out, priority=priority,
                     max_attempts=max_attempts, gpu_type=gpu_type, name=name, tags=labels.parse_tags(tag), note=note,
                     run=_dispatch, keep_queued=keep_queued)
        return
    ids = queue_screens(store, protocol, priority=priority, max_attempts=max_attempts, gpu_type=gpu_type,
                        replicas=replicas, spread=spread, name=name, note=note, tags=labels.parse_tags(tag))
    _warn(protocol)
    if not wait and json_out:
        echo_json({"queued": ids})
        return
    if not wait:
        typer.echo(f"queued screen{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}; "
                   f"run {'them' if len(ids) > 1 else 'it'} with `packbench dispatch`")
        return
    try:
        _dispatch(store, settings, json_out=json_out, only_screen=ids[0], workers=1, keep_queued=keep_queued)
    except KeyboardInterrupt:  # before the dispatcher's own handler (Ray starting) or after it
        typer.echo(interrupted_screen(store, ids[0], keep_queued=keep_queued), err=True)
        raise typer.Exit(signals.exit_code()) from None


def _warn(protocol: Path) -> None:
    """`warning: ...` lines on stderr for the queued screen (service/submit.py warnings_of: an
    archive over the audit bound, approximate conditions no gate judges); stdout stays the command's own."""
    from packbench.core.protocol import load
    from packbench.service.submit import warnings_of

    for warning in warnings_of(load(protocol)):
        typer.echo(f"warning: {warning}", err=True)


def interrupted_screen(store, screen_id: int, *, keep_queued: bool) -> str:
    """Give an interrupted `submit --wait` screen back: cancel it (its attempts are kept) unless
    it should stay queued; one line says which."""
    if keep_queued:
        return (f"interrupted: screen {screen_id} stays queued (--keep-queued); the next `packbench dispatch` "
                f"runs it, `packbench screens cancel {screen_id}` drops it")
    try:
        row = store.cancel_screen(screen_id)
    except PackbenchError as e:  # it finished meanwhile, or the database is gone
        return f"interrupted: screen {screen_id} not cancelled: {e}"
    if row.status == "cancelled":
        attempt = store.latest_attempt(screen_id)
        kept = f"attempt {attempt.number}, interrupted, is kept" if attempt is not None else "no attempt had started"
        return (f"interrupted: screen {screen_id} cancelled, so no `packbench dispatch` runs it unasked ({kept}); "
                f"`packbench screens retry {screen_id}` queues it again")
    return (f"interrupted: screen {screen_id} is still running elsewhere; a cancel is requested and it stops "
            f"after the episode in flight")


@app.command()
def dispatch(
    ctx: typer.Context,
    address: Address = None,
    follow: Annotated[bool, typer.Option("--follow", metavar="", help="Keep serving the queue until interrupted (SIGINT/SIGTERM "
                                                          "give held screens back to the queue), waiting out a "
                                                          "database outage of any length.")] = False,
    workers: Annotated[Optional[int], typer.Option(min=1, max=1024, help="Worker actors to keep (default: one per GPU of the "
                                                              "cluster).")] = None,
    lease: Annotated[float, typer.Option(min=1.0, callback=seconds, help="Seconds a claim holds without renewal; renewed every third.")] = 60.0,
    archive_dir: ArchiveDir = Path("archives"),
    db: DbUrl = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="One JSON object per screen, one per line (JSON Lines).")] = False,
) -> None:
    """Run queued screens on a pool of GPU workers, one screen per worker at a time.

    Exit codes: 0 every screen it ran is done, every episode ok and every verdict passed; 1 a
    verdict or an episode failed, or a screen failed (every episode failed), was cancelled or lost; 2 bad input (an unreadable protocol or checkpoint);
    74 the archive storage refused a write (a full disk: that screen is requeued, nothing more
    is claimed); 130/143 stopped by SIGINT/SIGTERM (held screens are back in the queue). With the database
    down, a one-shot dispatch gives up after its retries (exit 1); `--follow` waits for it, then
    reconciles the episodes its archives hold without rows and continues.
    """
    settings = settings_of(ctx, db_url=db, address=address, archive_dir=archive_dir)
    store = open_store(settings.db_url)
    output_dir(settings.archive_dir, "--archive-dir")  # unwritable from the start: claim nothing (no attempt spent)
    _dispatch(store, settings, json_out=json_out, follow=follow, workers=workers, lease_s=lease)


def _dispatch(store, settings: Settings, *, json_out: bool, keep_queued: bool = False, **options) -> None:
    from packbench.cli.progress import view
    from packbench.cluster.pool import RayPool
    from packbench.service.dispatcher import Dispatcher

    progress = view(json_out=json_out)

    def report(outcome) -> None:
        summary = screen_summary(store, outcome.screen_id)
        if json_out:  # what `results --screen N --json` prints: the stored summary and the archive's readings
            readings = query.readings_of(summary.get("archive_path"), screen_id=outcome.screen_id) or {}
            typer.echo(json.dumps({**summary, **readings}, default=str, sort_keys=True))
            return
        if outcome.requeued and outcome.status == "interrupted" and options.get("only_screen") is not None:
            return  # submit --wait: `interrupted_screen` says what becomes of the screen (cancelled, or kept queued)
        if outcome.requeued:  # the attempt failed, not the screen: say what happens next
            kept = (f"partial archive kept: {outcome.archive_path}" if Path(outcome.archive_path).exists()
                    else "no archive")
            progress.echo(f"attempt {outcome.attempt_number} {outcome.status}: {one_line(outcome.error or '')}; "
                          f"screen {outcome.screen_id} queued for attempt {outcome.attempt_number + 1} ({kept})",
                          err=True)
            return
        progress.echo(verdict_table(summary["verdicts"], caveat=summary["fidelity_caveat"]) if summary["verdicts"] else "no verdicts")
        # An archive never created (the storage refused it) is not named as if it were there.
        where = f"archive: {outcome.archive_path}" if Path(outcome.archive_path).exists() else "no archive"
        progress.echo(f"screen {outcome.screen_id}: {outcome.status}; {where}")
        if outcome.status != "done":
            progress.echo(f"error: screen {outcome.screen_id} {outcome.status}: {one_line(outcome.error or '')}",
                          err=True)
        elif outcome.failed_episodes:  # done, measured, yet not every episode ran: never silent (exit 1)
            progress.echo(f"error: screen {outcome.screen_id}: {outcome.failed_episodes} of {outcome.episodes} "
                          f"episodes failed; the first, {one_line(outcome.first_failure or '')} (each episode's "
                          f"error: `packbench screens show {outcome.screen_id} --json`)", err=True)

    dispatcher = Dispatcher(store, settings, RayPool(settings), progress=progress, on_outcome=report, **options)
    # Until the dispatcher's own handler is in place (starting Ray takes seconds), SIGTERM exits as
    # Ray's driver handler, installed by ray.init, makes it exit: sys.exit(15). Caught here, it stops
    # the dispatcher as its handler would (nothing is claimed yet). Before, submit --wait exited 15
    # with no line and left its screen queued for the next dispatch to run unasked.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum)) if main else None
    try:
        outcomes = dispatcher.run()
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        dispatcher.stopping, outcomes = "SIGTERM", dispatcher.outcomes
    finally:
        progress.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if dispatcher.stopping == "archive":  # the storage's fault, not the input's: its own exit code
        typer.echo(f"error: {dispatcher.fatal}; every other screen stays queued: free space (or fix the mount) "
                   f"under {settings.archive_dir}, then run `packbench dispatch` again", err=True)
        raise typer.Exit(74)
    if dispatcher.fatal:
        typer.echo(f"error: {dispatcher.fatal}", err=True)
        raise typer.Exit(1)
    if dispatcher.stopping and dispatcher.outage is not None:
        typer.echo(f"stopped by {dispatcher.stopping} while the database was unavailable: held screens go back to "
                   f"the queue when their leases expire; once it is back, `packbench db reconcile` inserts the "
                   f"rows of episodes their archives hold", err=True)
        raise typer.Exit(130 if dispatcher.stopping == "SIGINT" else 143)
    if dispatcher.stopping:
        only = options.get("only_screen")
        typer.echo(f"stopped by {dispatcher.stopping}; held screens are back in the queue" if only is None else
                   interrupted_screen(store, only, keep_queued=keep_queued), err=True)
        raise typer.Exit(130 if dispatcher.stopping == "SIGINT" else 143)
    if not outcomes and dispatcher.refusals and not any(s.ready for s in dispatcher.slots):
        only = options.get("only_screen")
        kept = f"; screen {only} stays queued" if only else ""
        raise PackbenchError(f"no GPU worker could start: {dispatcher.refusals[0]}{kept}")
    if not outcomes:
        typer.echo("no queued screens", err=json_out)
        for line in dispatcher.held:
            typer.echo(one_line(line), err=True)
    # A requeued attempt is settled by the screen's next one, when this dispatcher ran it too.
    failed = [o for i, o in enumerate(outcomes) if o.status != "done" and not (
        o.requeued and any(later.screen_id == o.screen_id for later in outcomes[i + 1:]))]
    if failed:
        raise typer.Exit(2 if all(o.bad_input for o in failed) else 1)
    if any(o.failed_episodes for o in outcomes):
        raise typer.Exit(1)  # a done screen with failed episodes: a script can tell
    if any(not v.passed for o in outcomes for v in store.verdicts(o.attempt_id)):
        raise typer.Exit(1)  # a failed verdict: a script can tell (the screen itself is done)


query.register(app)
report.register(app)
protocol_cmd.register(app)
keys.register(app)
ingest.register(app)
audit_cmd.register(app)
history.register(app)
simulate_cmd.register(app)
model_stats.register(model_app)


def main() -> None:
    """Console entry point: user errors print one line and exit 2, never a traceback (--debug adds it);
    so do typer's usage errors (an unknown option, a missing argument), not rich's boxes. Any other
    exception is a bug: one line naming the file its traceback went to, exit 70."""
    stdout = sys.stdout = WatchedOutput(sys.stdout)
    _drop_unusable_columns()
    try:
        code = app(standalone_mode=False, prog_name="packbench")  # usage errors reach us here: one line
        if isinstance(code, int) and code:
            sys.exit(code)
    except typer.TyperException as e:  # typer's usage errors: an unknown option, a missing argument, ...
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as typer shows it
            e.show()  # type: ignore[attr-defined]
            sys.exit(2)
        ctx = getattr(e, "ctx", None)
        where = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
        typer.echo(error_line(f"error: {' '.join(e.format_message().split()).rstrip('.')}{where}"), err=True)
        sys.exit(2)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    except PackbenchError as e:
        # one_line: a message that quotes the input raw (`history $'\n'`'s hint) still prints one line
        typer.echo(error_line(f"error: {e}"), err=True)
        if isinstance(e, ClusterUnreachable):
            # Ray may still be retrying the join in a background thread (and printing): leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        sys.exit(2)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM once Ray is up (core/signals.py)
        typer.echo(signals.stop_line(), err=True)
        sys.exit(signals.exit_code())
    except SystemExit as e:
        # SIGTERM while ray.init runs meets Ray's own handler, `sys.exit(15)`: the same stop, said so.
        if e.code != signal.SIGTERM:
            raise
        typer.echo("terminated (SIGTERM)", err=True)
        sys.exit(143)
    except OSError as e:
        if e is stdout.refused:
            # `results > out.csv` on a full disk, or `results >&-`: where the output goes refused it, no bug
            fix = ("stdout is closed: give the command one, e.g. `> out.txt` or `> /dev/null`" if e.errno == errno.EBADF
                   else "free space where stdout goes, or send it elsewhere")
            typer.echo(one_line(f"error: cannot write the output to stdout ({e.strerror or e}); {fix}"), err=True)
            stdout.silence()
            sys.exit(2)
        if e.errno != errno.ENAMETOOLONG:  # a bug, as below
            typer.echo(unexpected(e), err=True)
            sys.exit(UNEXPECTED_EXIT)
        # A path given on the command line (an argument, an option, --db's file) with a name the
        # file system cannot hold: every command reaches its paths through the OS, so one answer.
        typer.echo(one_line(f"error: the path {show(e.filename)} is longer than the file system allows "
                            f"({e.strerror}); give a shorter path"), err=True)
        sys.exit(2)
    except Exception as e:  # a bug, not bad input: its own exit code, and the traceback kept in a file
        typer.echo(unexpected(e), err=True)
        sys.exit(UNEXPECTED_EXIT)
    finally:
        if sys.stdout is stdout:
            sys.stdout = stdout.stream


MAX_COLUMNS = 10_000  # a help page wider than this is padding: 100,000 columns wrote 3.9 MB of --help


def _drop_unusable_columns() -> None:
    """Forget $COLUMNS when --help (rich) cannot draw at that width: 99999999999999999999 was an
    OverflowError (exit 70), 0 a blank page. The terminal's own width (or 80) is used instead."""
    text = os.environ.get("COLUMNS")
    if text is not None and text.strip().isdigit() and not 1 <= int(text) <= MAX_COLUMNS:
        del os.environ["COLUMNS"]


class WatchedOutput:
    """sys.stdout as it was, remembering the OSError a write or flush of it raised: what lets `main`
    tell a full disk under `results > out.csv` (no bug) from a failed write of packbench's own."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.refused: OSError | None = None

    def write(self, text):
        try:
            return self._open().write(text)
        except OSError as e:
            self.refused = e
            raise

    def flush(self) -> None:
        try:
            self._open().flush()
        except OSError as e:
            self.refused = e
            raise

    def _open(self):
        """The stream; an OSError (EBADF) where there is none: the interpreter sets sys.stdout to None
        when descriptor 1 was closed at start (`packbench results >&-`), and a write to None was an
        AttributeError, reported as a packbench bug (exit 70)."""
        if self.stream is None:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return self.stream

    def silence(self) -> None:
        """Point stdout's descriptor at /dev/null: the interpreter's flush at exit would fail again
        (printing 'Exception ignored' and exiting 120)."""
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's StringIO): nothing flushes at exit
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


UNEXPECTED_EXIT = 70  # sysexits.h EX_SOFTWARE: an internal error, never 2 (bad input)


def unexpected(error: Exception) -> str:
    """One line for an unexpected exception, naming the file its traceback was written to
    (a temporary file: the terminal gets one line, the report gets the whole story)."""
    import tempfile

    text = "".join(traceback.format_exception(error))
    try:
        fd, where = tempfile.mkstemp(prefix="packbench-traceback-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"packbench {' '.join(sys.argv[1:])}\n{text}")
        kept = f"traceback in {where}"
    except OSError:  # no writable temporary directory: the traceback goes to the terminal after all
        sys.stderr.write(text)
        kept = "traceback above"
    return one_line(f"error: unexpected {type(error).__name__}: {str(error)[:300]} ({kept}); this is a packbench bug: "
                    f"report it with the command you ran and that traceback")
