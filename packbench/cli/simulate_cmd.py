"""`packbench simulate TRACE`: every policy's ledger replayed on a trace file (core/simulate.py),
with a predicted decode time on a named machine (bench/machines/NAME.json, or a file)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Optional

import typer

from packbench.core.errors import PackbenchError
from packbench.core.text import counted, one_line

# Machine files: the checkout's bench/machines/, or the working directory's (an installed wheel).
MACHINE_DIRS = (Path(__file__).resolve().parents[2] / "bench" / "machines", Path("bench") / "machines")
MAX_MACHINE_BYTES = 1 << 20


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)


def simulate(
    trace: Annotated[Path, typer.Argument(help="A trace file (docs/traces.md): `packbench model stats DIR --trace OUT`, "
                                                "a screen's archived trace, or one written from a published routing dump.",
                                           show_default=False)],
    policy: Annotated[Optional[list[str]], typer.Option(
        help="A policy to replay, `name` or `name:key=value,...` (packet:gather=device, "
             "row-retention:rows_per_layer=512, dense-stream:weights=int8); repeat it. Default: every policy "
             "the trace's model family has.")] = None,
    machine: Annotated[Optional[str], typer.Option(
        help="Predict decode time on this machine: a name under bench/machines/ (h200, h100) or a JSON file of its "
             "measured rates (docs/traces.md, \"Machines\").")] = None,
    per_call: Annotated[bool, typer.Option("--per-call", help="Also print every call's bytes (JSON: always there).")] = False,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print every figure as JSON.")] = False,
) -> None:
    """Replay every loader policy's ledger (bytes host-to-device, rows or experts moved, readbacks, cache hits,
    forecast waste) on a trace of active sets, as the engine counts them, with no weights; with --machine, the
    decode time predicted from that machine's measured rates. A simulation, never a measurement."""
    from packbench.core import simulate as sim
    from packbench.core.trace import TraceError, read_trace

    try:
        t = read_trace(trace)
    except TraceError as e:
        raise PackbenchError(f"TRACE: {e}") from None
    m = t.model
    specs = policy or default_policies(m, has_forecasts=t.forecasts is not None)
    try:
        parsed = [(text, *sim.parse_policy(text, m.unit)) for text in specs]
    except sim.SimulateError as e:
        raise PackbenchError(f"--policy: {e}") from None
    rates = load_machine(machine) if machine is not None else None
    for text, name, params in parsed:  # every refusal before any replay (a long trace takes a while)
        try:
            sim.check(t, name, params)
        except (sim.SimulateError, ValueError) as e:
            raise PackbenchError(f"--policy {text}: {e}") from None
    rows = []
    for text, name, params in parsed:
        try:
            calls = sim.ledger(t, name, params)
        except (sim.SimulateError, ValueError) as e:
            raise PackbenchError(f"--policy {text}: {e}") from None
        totals = sim.totals(calls)
        row = {"policy": text, "name": name, "params": params, "totals": totals, "calls": calls}
        if rates is not None:
            row["prediction"] = sim.predict(t, name, params, calls, rates)
        rows.append(row)
    out = {"trace": str(trace), "model": m.as_dict(), "source": t.source, "calls": len(t.calls),
           "episodes": len(t.episodes()), "policies": rows,
           "assumptions": ASSUMPTIONS, "machine": rates}
    if json_out:
        typer.echo(json.dumps(out, sort_keys=True))
        return
    typer.echo(render(out, per_call=per_call))


ASSUMPTIONS = ("a simulation from a trace, not a measurement: bytes are the engine's ledger rules (core/charges.py) "
               "on the trace's sets, each episode with a fresh policy as a screen runs it; time per decode token = "
               "the machine's measured compute (the policy family's own zero-copy decode where the machine file "
               "has it, else resident's; each prediction's compute_source says which) + the decode bytes at its "
               "pinned copy rate, serial "
               "(overlapped, the larger of the two, for OPT dense-stream) + the engine's fixed costs of MoE policies "
               "where the machine file measured them (overhead_us: per layer, per expert moved, per routed expert of "
               "a cache, per forecast; serial; a family's own compute holds its per-layer and per-routed terms; "
               "the output says where the term is missing); index bytes count as "
               "copied bytes; an expert cache hit costs no copy, and a forecast's prefetch overlaps one layer's share "
               "of the compute (per decode call and layer the smaller of the two is hidden; the rest is serial)")


def default_policies(model, *, has_forecasts: bool = True) -> list[str]:
    from packbench.core.simulate import DEFAULT_POLICIES, MAX_RETENTION_ROWS

    rows = max(1, model.units // 10)  # row-retention: a cache of a tenth of each layer's rows
    cap = max(1, model.units // 4)  # expert caches: a quarter of each layer's experts
    names = [p.replace("ROWS", str(rows)).replace("CAP", str(cap)) for p in DEFAULT_POLICIES[model.unit]]
    if model.layers * model.units > MAX_RETENTION_ROWS:  # too many rows to keep a slot for each: left out
        names = [n for n in names if not n.startswith("row-retention")]
    if getattr(model, "unit", None) == "expert" and not has_forecasts:
        names = [n for n in names if "forecast" not in n]  # a trace without forecast sets cannot replay them
    return names


def load_machine(spec: str) -> dict:
    """A machine's rates: bench/machines/SPEC.json for a bare name, else the file SPEC."""
    from packbench.core.simulate import machine_problem
    from packbench.core.trace import StrictJSONError, strict_json

    by_name = "/" not in spec and not spec.endswith(".json")
    path = next((d / f"{spec}.json" for d in MACHINE_DIRS if (d / f"{spec}.json").is_file()), None) if by_name \
        else Path(spec)
    if path is None:
        known = sorted({p.stem for d in MACHINE_DIRS if d.is_dir() for p in d.glob("*.json")})
        raise PackbenchError(f"--machine {spec}: no such machine; use one of {', '.join(known) or 'none'} "
                             f"or a JSON file of its rates")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise PackbenchError(f"--machine {spec}: cannot read it ({e.strerror}); give a machine JSON file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PackbenchError(f"--machine {spec} is not a regular file; give a machine JSON file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_MACHINE_BYTES + 1)
    if len(data) > MAX_MACHINE_BYTES:
        raise PackbenchError(f"--machine {spec} is over {MAX_MACHINE_BYTES} bytes; a machine file is a small JSON object")
    try:
        machine = strict_json(data)
    except StrictJSONError as e:
        raise PackbenchError(f"--machine {spec} {e}; write the object docs/traces.md shows") from None
    except (ValueError, RecursionError):  # RecursionError: arrays nested ~100,000 deep fit in the bound
        raise PackbenchError(f"--machine {spec} is not JSON; write the object docs/traces.md shows") from None
    problem = machine_problem(machine)
    if problem:
        raise PackbenchError(f"--machine {spec}: {problem}")
    return machine


def _opt(v) -> str:
    return "-" if v is None else str(v)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f}"


def render(out: dict, *, per_call: bool = False) -> str:
    m = out["model"]
    unit = m["unit"] + "s"
    lines = [f"{out['trace']}: {m['family']} {m['shape'] or '(unnamed shape)'}, {counted(m['layers'], 'layer')} x "
             f"{counted(m['units'], m['unit'])} of {m['unit_bytes']:,} B, {m['dtype']}; {counted(out['episodes'], 'episode')}, "
             f"{counted(out['calls'], 'call')}",
             f"source: {json.dumps(out['source'], sort_keys=True)}", "",
             f"{'policy':44} {'prefill MB/call':>16} {'decode MB/token':>16} {unit + '/decode':>14} "
             f"{'wasted':>8} {'hits':>8} {'misses':>8} {'hit%':>6} {'belady%':>8} {'prefetch':>8} {'used':>8} "
             f"{'pred ms/token':>14} {'pred steady ms':>14}"]
    for row in out["policies"]:
        p, d = row["totals"]["prefill"], row["totals"]["decode"]
        pre = (p["h2d_weight_bytes"] + p["h2d_index_bytes"]) / p["calls"] if p["calls"] else 0
        dec = (d["h2d_weight_bytes"] + d["h2d_index_bytes"]) / d["tokens"] if d["tokens"] else 0
        moved = d["rows_copied"] / d["calls"] if d["calls"] else 0
        pred = row.get("prediction", {}).get("decode_ms_per_token")
        steady = row.get("prediction", {}).get("steady_call_ms")
        lines.append(f"{row['policy']:44} {_mb(pre):>16} {_mb(dec):>16} {moved:14.1f} "
                     f"{d['rows_wasted']:8d} {_opt(d.get('hits')):>8} {_opt(d.get('misses')):>8} "
                     f"{_pct(d.get('hit_rate')):>6} {_pct(d.get('belady_rate')):>8} {_opt(d.get('prefetched')):>8} "
                     f"{_opt(d.get('used')):>8} {'-' if pred is None else f'{pred:.2f}':>14} "
                     f"{'-' if steady is None else f'{steady:.2f}':>14}")
        if per_call:
            for c in row["calls"]:
                cache = "".join(f", {key} {sum(v for v in c[key] if v is not None)}"
                                for key in ("hits", "misses", "prefetched", "used", "belady_hits")
                                if any(v is not None for v in c.get(key, [])))
                lines.append(f"    call {c['index']:4d} ep {c['episode']} {c['phase']:7} {c['tokens']:5d} tok: "
                             f"{sum(c['h2d_weight_bytes']):,} B weights, {sum(c['h2d_index_bytes']):,} B index, "
                             f"{sum(c['rows_copied'])} {unit}{cache}")
    if out["machine"] is not None:
        lines += ["", f"machine {out['machine']['name']}: pinned copy {out['machine']['pinned_h2d_gbps']['value']} GB/s "
                      f"({out['machine']['pinned_h2d_gbps']['source']})"]
        first = next((r["prediction"] for r in out["policies"]), {})
        lines.append("compute: " + (first.get("compute_source") or first.get("why", "-")))
        for r in out["policies"]:  # a family's own compute where the machine file has it
            if r["prediction"].get("compute_source", first.get("compute_source")) != first.get("compute_source"):
                lines.append(f"compute of {r['policy']}: {r['prediction']['compute_source']}")
        for r in out["policies"]:
            if r["prediction"].get("overhead"):
                lines.append(f"overhead of {r['policy']}: {r['prediction']['overhead']}")
        for r in out["policies"]:
            hidden = r["prediction"].get("prefetch_hidden_ms_per_token")
            if hidden is not None:
                lines.append(f"prefetch of {r['policy']}: {hidden:.2f} ms a token of its "
                             f"{r['prediction']['copy_ms_per_token']:.2f} ms copy hidden by compute")
    lines += ["", "MB: 10^6 bytes host-to-device (weights and indices). hits, misses, hit% (of routed), belady% "
                  "(Belady's optimal cache of the same capacity), prefetch and used (forecast): decode calls. "
                  "pred ms/token: the mean over the decode calls; pred steady ms: the steady decode call (each "
                  "call priced alone; per episode the median but the first call, then the median over episodes), "
                  "what a screen reports as decode ms/token. "
              + out["assumptions"] + "."]
    # A trace's family, shape, dtype and source and a machine file's name and sources are free text:
    # each line is escaped (core/text.py), so a newline or a terminal escape in one cannot split or
    # repaint the table.
    return "\n".join(one_line(line) for line in lines)
