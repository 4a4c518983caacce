"""Sweeps on the command line: `submit --sweep`, `protocol plan --sweep`, `report --sweep ID`.

Thin: service/sweep.py expands and freezes the points and queues them; this module prints
what was queued or planned, and writes the sweep's page (cli/sweep_page.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from packbench.cli.common import echo_json, output_dir, write_output
from packbench.core.errors import PackbenchError


def submit_sweep(store, settings, protocol: Path, specs: list[str], *, wait: bool, json_out: bool,
                 run: Callable[..., None], keep_queued: bool = False, **submit: Any) -> None:
    """Queue one screen per point; with --wait, run each in turn (exit: the worst of theirs). An
    interrupted --wait gives back what it queued as `submit --wait` does its screen: the point
    running and every point not yet run are cancelled, or with `keep_queued` all stay queued."""
    from packbench.service.sweep import parse_axes, submit_sweep as queue

    axes = parse_axes(specs)
    if wait:
        output_dir(settings.archive_dir, "--archive-dir")  # before anything is queued
    sweep_id, queued = queue(store, protocol, axes, **submit)
    if json_out and not wait:
        typer.echo(json.dumps({"sweep_id": sweep_id, "screens": [
            {"screen_id": i, "point": p.values, "protocol_sha256": p.frozen.sha256} for i, p in queued]},
            sort_keys=True))
    elif not json_out:
        for screen_id, p in queued:
            typer.echo(f"screen {screen_id}: {_point(p.values)} (protocol {p.frozen.sha256[:12]})")
        typer.echo(f"queued sweep {sweep_id}: {len(queued)} screens"
                   + ("" if wait else "; run them with `packbench dispatch`, then "
                                      f"`packbench report --sweep {sweep_id}`"))
    if not wait:
        return
    codes = []
    for n, (screen_id, _) in enumerate(queued):
        try:
            run(store, settings, json_out=json_out, only_screen=screen_id, workers=1, keep_queued=keep_queued)
        except typer.Exit as e:
            if e.exit_code in (130, 143):
                _give_back(store, sweep_id, [i for i, _ in queued[n + 1:]], keep_queued=keep_queued)
                raise
            codes.append(e.exit_code)
        except KeyboardInterrupt:  # before the dispatcher's own handler (Ray starting) or after it
            from packbench.cli.main import interrupted_screen
            from packbench.core import signals

            typer.echo(interrupted_screen(store, screen_id, keep_queued=keep_queued), err=True)
            _give_back(store, sweep_id, [i for i, _ in queued[n + 1:]], keep_queued=keep_queued)
            raise typer.Exit(signals.exit_code()) from None
    if not json_out:
        typer.echo(f"sweep {sweep_id}: plot it with `packbench report --sweep {sweep_id}`")
    if any(codes):
        raise typer.Exit(max(codes))


def _give_back(store, sweep_id: str, rest: list[int], *, keep_queued: bool) -> None:
    """The points an interrupted `submit --sweep --wait` did not reach: cancelled, so no later
    `packbench dispatch` runs them unasked, or kept queued (--keep-queued); one line says which."""
    if not rest:
        return
    ids = ", ".join(map(str, rest))
    if keep_queued:
        typer.echo(f"sweep {sweep_id}: screens {ids} not run, stay queued (--keep-queued); the next "
                   f"`packbench dispatch` runs them", err=True)
        return
    kept = []
    for screen_id in rest:
        try:
            if store.cancel_screen(screen_id).status != "cancelled":
                kept.append(screen_id)
        except PackbenchError:  # the database is gone: they stay as they are
            kept.append(screen_id)
    done = [i for i in rest if i not in kept]
    if done:
        typer.echo(f"sweep {sweep_id}: screens {', '.join(map(str, done))} not run, cancelled; "
                   f"`packbench screens retry N` queues one again", err=True)
    if kept:
        typer.echo(f"sweep {sweep_id}: screens {', '.join(map(str, kept))} could not be cancelled; "
                   f"`packbench screens cancel N` drops one", err=True)


def _point(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def plan_sweep(protocol: Path, specs: list[str], *, estimate_of: Callable[[Any], dict], json_out: bool) -> None:
    """`protocol plan --sweep`: each point, its protocol hash, episodes and estimated bytes and
    transfer time (`estimate_of(frozen)` is protocol plan's own estimate of one protocol)."""
    from packbench.cli.summary import table
    from packbench.core.plan import plan
    from packbench.service.sweep import parse_axes, points

    rows = []
    for p in points(protocol, parse_axes(specs)):
        est = estimate_of(p.frozen)
        rows.append({**p.values, "sha256": p.frozen.sha256[:12], "episodes": len(plan(p.frozen.protocol)),
                     "h2d_bytes": est["total_bytes"], "transfer_s": est["total_transfer_s"]})
    if json_out:
        typer.echo(json.dumps({"points": rows}, sort_keys=True, indent=2))
        return
    typer.echo(f"{len(rows)} points, one protocol (and screen) each; bytes and the GPU transfer floor as "
               f"`packbench protocol plan` estimates them")
    shown = [{**{k: v for k, v in r.items() if k not in ("h2d_bytes", "transfer_s")},
              "host-to-device": f"{r['h2d_bytes'] / 1e6:,.4g} MB", "GPU transfer": f"{r['transfer_s'] * 1e3:,.4g} ms"}
             for r in rows]
    typer.echo(table(shown, list(shown[0])))
    typer.echo(f"sweep: {sum(r['episodes'] for r in rows)} episodes, {sum(r['h2d_bytes'] for r in rows) / 1e6:,.4g} MB "
               f"host-to-device, >= {sum(r['transfer_s'] for r in rows) * 1e3:,.4g} ms of transfer on a GPU")


def report_sweep(store, sweep_id: str, out: Path | None, *, json_out: bool = False) -> None:
    """`report --sweep ID`: write the sweep's page; with `json_out` say so as one JSON document
    (as `report SCREEN --json` does), where plain text was printed."""
    from packbench.cli.sweep_page import sweep_page
    from packbench.service.sweep import resolve_sweep, sweep_points

    sweep_id = resolve_sweep(store, sweep_id)
    pts = sweep_points(store, sweep_id)
    if not any(p.figures for p in pts):
        waiting = [p.screen_id for p in pts if p.status in ("queued", "running")]
        if waiting:
            raise PackbenchError(f"sweep {sweep_id} has no episodes yet; run its screens with `packbench dispatch`")
        # Every screen stopped (failed or cancelled): dispatch runs none of them, so saying "run its
        # screens with `packbench dispatch`" sent the user to a command that does nothing.
        ended = ", ".join(f"{p.screen_id} {p.status}" for p in pts)
        raise PackbenchError(f"sweep {sweep_id} has no finished scored episode and none to come (screens {ended}); "
                             f"`packbench screens show N` says why, `packbench screens retry N` queues one again")
    path = out or Path(f"sweep-{sweep_id}.html")
    write_output(path, sweep_page(sweep_id, pts), "--out")
    if json_out:
        echo_json({"path": str(path), "bytes": path.stat().st_size, "sweep_id": sweep_id,
                   "screens": [p.screen_id for p in pts]})
        return
    typer.echo(f"wrote {path} ({path.stat().st_size:,} bytes)")
